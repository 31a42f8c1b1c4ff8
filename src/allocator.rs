//! The gateway's global allocator: mimalloc, called the way its plain `malloc` is fastest.
//!
//! The `mimalloc` crate's allocator passes every allocation to `mi_malloc_aligned`, whose
//! fast path gives up whenever the size's free list is empty; its fallback then takes the
//! plain path only for power-of-two block sizes, and for every other size over-allocates
//! from the next larger size class, marking that page as holding interior pointers (slower
//! to free). Once a size class's free list has run dry, every later allocation of that
//! size takes that detour, since only the plain path refills the list. In the request path
//! that was about four allocations a request, some 1k instructions (callgrind,
//! `bench/request_cost.sh`).
//!
//! A type's size is a multiple of its alignment, and every mimalloc size class is a
//! multiple of 8 bytes, of 16 above 16, with each page's first block 16-aligned: so for an
//! alignment up to 16 (`MI_MAX_ALIGN_SIZE`) the plain calls return suitably aligned
//! memory, as Rust's own `System` allocator relies on for `malloc`. Larger alignments keep
//! the aligned calls.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys::{
    mi_free, mi_malloc, mi_malloc_aligned, mi_realloc, mi_realloc_aligned, mi_zalloc, mi_zalloc_aligned,
};

/// The largest alignment mimalloc's plain calls guarantee (`MI_MAX_ALIGN_SIZE`).
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator: `#[global_allocator] static A: Mimalloc = Mimalloc;`.
pub struct Mimalloc;

/// Whether the plain calls serve an allocation of `size` bytes aligned to `align`: a size
/// that is a multiple of the alignment (always so for a type; a hand-made `Layout` may be
/// 24 bytes aligned to 16, which mimalloc's 24-byte class does not honour).
fn plain(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size && size.is_multiple_of(align)
}

/// A plain mimalloc allocation call: `mi_malloc(size)` or `mi_zalloc(size)`.
type Plain = unsafe extern "C" fn(usize) -> *mut c_void;
/// An aligned one: `mi_malloc_aligned(size, alignment)` or `mi_zalloc_aligned`.
type Aligned = unsafe extern "C" fn(usize, usize) -> *mut c_void;

/// Allocates `layout` with the plain call where it suffices, else with the aligned one.
///
/// # Safety
/// `plain` and `aligned` are mimalloc's allocation calls, which accept any size and
/// power-of-two alignment.
#[inline]
unsafe fn allocate(layout: Layout, plain_call: Plain, aligned_call: Aligned) -> *mut u8 {
    // SAFETY: the caller passes mimalloc's calls.
    unsafe {
        if plain(layout.size(), layout.align()) {
            plain_call(layout.size()).cast()
        } else {
            aligned_call(layout.size(), layout.align()).cast()
        }
    }
}

// SAFETY: every pointer returned comes from mimalloc, which is thread-safe, with at least
// the layout's size and alignment (module docs); every pointer freed or reallocated was
// returned by it, and mimalloc frees and reallocates aligned and plain blocks alike.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's own allocation calls.
        unsafe { allocate(layout, mi_malloc, mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's own zeroing allocation calls.
        unsafe { allocate(layout, mi_zalloc, mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (the caller's contract).
        unsafe { mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by this allocator with `layout` (the caller's
        // contract); the new block keeps the alignment, as `alloc` explains.
        unsafe {
            if plain(new_size, layout.align()) {
                mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain calls serve an alignment up to 16 whose size is a multiple of it: a
    /// 24-byte block aligned to 16 or anything aligned beyond 16 takes the aligned calls
    /// (what today's mimalloc happens to align anyway, the test below cannot tell).
    #[test]
    fn only_small_alignments_of_a_multiple_size_take_the_plain_calls() {
        assert!(plain(1, 1) && plain(24, 8) && plain(32, 16) && plain(4096, 16));
        assert!(!plain(24, 16), "24 bytes is not a multiple of 16");
        assert!(!plain(4, 8), "smaller than its alignment");
        assert!(!plain(64, 32) && !plain(4096, 4096), "beyond 16");
    }

    /// Allocates, reallocates and frees blocks of alignments up to 4 KiB and sizes in steps
    /// of 8 bytes (multiples of the alignment or not), many at a time (so that size classes
    /// run dry and refill), and checks that each block is aligned and keeps its contents.
    #[test]
    fn every_block_is_aligned_and_keeps_its_contents() {
        let allocator = Mimalloc;
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in (align..=(3 * 1024).max(2 * align)).step_by(8) {
                let layout = Layout::from_size_align(size, align).unwrap();
                let mut blocks = Vec::new();
                for i in 0..64u8 {
                    // SAFETY: the layout's size is not zero; each block is freed below
                    // with its layout.
                    let block = unsafe {
                        if i % 2 == 0 {
                            allocator.alloc(layout)
                        } else {
                            allocator.alloc_zeroed(layout)
                        }
                    };
                    assert!(!block.is_null());
                    assert_eq!(block as usize % align, 0, "size {size}, align {align}");
                    if i % 2 == 1 {
                        // SAFETY: the block holds `size` bytes, zeroed.
                        let zeroed = unsafe { std::slice::from_raw_parts(block, size) };
                        assert!(zeroed.iter().all(|&byte| byte == 0));
                    }
                    // SAFETY: the block holds `size` bytes.
                    unsafe { block.write_bytes(i, size) };
                    blocks.push((block, i));
                }
                for (block, fill) in &mut blocks {
                    let grown = size + align;
                    // SAFETY: `block` came from this allocator with `layout`; the grown
                    // block is freed below with its own layout.
                    let moved = unsafe { allocator.realloc(*block, layout, grown) };
                    assert!(!moved.is_null());
                    assert_eq!(
                        moved as usize % align,
                        0,
                        "realloc {size} -> {grown}, align {align}"
                    );
                    // SAFETY: the first `size` bytes were copied over.
                    let kept = unsafe { std::slice::from_raw_parts(moved, size) };
                    assert!(kept.iter().all(|byte| byte == fill));
                    *block = moved;
                }
                let grown = Layout::from_size_align(size + align, align).unwrap();
                for (block, _) in blocks {
                    // SAFETY: allocated above with `grown`.
                    unsafe { allocator.dealloc(block, grown) };
                }
            }
        }
    }
}
