//! Rate limiting: the algorithms, store keys, and the stores that decide.

pub mod algorithm;
pub mod key;
