//! What the process really allocates: a counting global allocator.
//!
//! The engine's [`MemoryReport`](zero_core::MemoryReport) counts its own
//! buffers; it cannot see Candle's gradients, activations or copies. The
//! `train` and `bench` binaries install [`CountingAllocator`] as their
//! global allocator, so `--metrics` and `bench memory` report the heap the
//! process actually holds. Library users (and the in-process tests) that do
//! not install it get `None` from [`peak_bytes`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting the bytes live and their peak. Two
/// relaxed atomic operations per allocation, no lock.
pub struct CountingAllocator;

impl CountingAllocator {
    fn grew(size: usize) {
        let now = CURRENT.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }

    fn shrank(size: usize) {
        CURRENT.fetch_sub(size, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the caller's layout and
// pointer unchanged; the counters are side effects only.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl's comment).
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        Self::shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                Self::shrank(layout.size() - new_size);
            }
        }
        new
    }
}

/// Heap bytes live now, when the counting allocator is installed.
pub fn current_bytes() -> Option<usize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| CURRENT.load(Ordering::Relaxed))
}

/// The most heap bytes live at once since the start (or the last
/// [`reset_peak`]), when the counting allocator is installed.
pub fn peak_bytes() -> Option<usize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| PEAK.load(Ordering::Relaxed))
}

/// Starts a new peak from what is live now (between benchmark phases).
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}
