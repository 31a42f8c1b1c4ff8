//! Sets of bytes as 256-entry tables built at compile time: where every byte of every
//! request head is tested (header names, key parts), one load a byte beats a chain of
//! comparisons.

/// `byte_set!(|b| TEST)`: a `[bool; 256]` that is true for each byte `b` passing `TEST`
/// (a `const` expression of `b: u8`).
macro_rules! byte_set {
    (|$b:ident| $test:expr) => {{
        let mut set = [false; 256];
        let mut byte = 0;
        while byte < 256 {
            let $b = byte as u8;
            set[byte] = $test;
            byte += 1;
        }
        set
    }};
}
