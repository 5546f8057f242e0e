//! # zero-candle
//!
//! The Candle adapter of zero-rs. Being written.
#![warn(missing_docs)]
