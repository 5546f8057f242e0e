//! Offloaded host memory: [`HostBuffer`], page-locked through a
//! [`HostLock`] where the device can, and lent to the step thread as a
//! [`HostRegion`].

use crate::Result;
use std::ops::Range;

/// What keeps host memory page-locked (see [`HostTransfers::pin_host`](crate::engine::HostTransfers::pin_host)).
pub trait HostLock: Send + Sync {
    /// Unlocks the memory once no queued copy reads or writes it any more;
    /// `false` when one still may (it did not land within the device's
    /// deadline): then the memory stays locked and must not be freed.
    fn unlock(self: Box<Self>) -> bool;
}

/// A [`HostLock`] held by a buffer.
pub type HostPin = Box<dyn HostLock>;

/// Waits, within the device's deadline, for the transfers queued before it
/// was taken (see [`HostTransfers::landing`](crate::engine::HostTransfers::landing)) and none queued later.
pub type Landing = Box<dyn FnOnce() -> Result<()> + Send>;

/// An offloaded buffer in host memory, page-locked where the device memory
/// can (its transfers then run at the link's speed, without staging). Its
/// length is fixed: the locked range must not move.
pub struct HostBuffer<T> {
    /// Unlocked before the values are freed (see the `Drop`).
    pin: Option<HostPin>,
    values: Vec<T>,
    /// The buffer's elements within `values`.
    range: Range<usize>,
}

/// What a page-locked buffer is aligned to and padded to: whole pages of
/// its own (two buffers never lock the same page), on any page size up to
/// this.
const PIN_ALIGN: usize = 64 << 10;

impl<T: Clone + Default> HostBuffer<T> {
    /// `numel` zeros in pageable memory.
    pub fn pageable(numel: usize) -> Self {
        Self {
            pin: None,
            values: vec![T::default(); numel],
            range: 0..numel,
        }
    }

    /// `numel` zeros on pages of their own, locked by `lock` (given the
    /// whole pages; it returns what keeps them locked, `None` where
    /// nothing was locked).
    pub fn pinned(
        numel: usize,
        lock: impl FnOnce(&mut [T]) -> Result<Option<HostPin>>,
    ) -> Result<Self> {
        let size = std::mem::size_of::<T>().max(1);
        let pad = PIN_ALIGN.div_ceil(size);
        let mut values = vec![T::default(); numel + 2 * pad];
        let addr = values.as_ptr() as usize;
        let start = (addr.next_multiple_of(PIN_ALIGN) - addr) / size;
        let locked = (numel * size).next_multiple_of(PIN_ALIGN) / size;
        let pin = lock(&mut values[start..start + locked])?;
        Ok(Self {
            pin,
            values,
            range: start..start + numel,
        })
    }
}

impl<T> HostBuffer<T> {
    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// The elements `range`, without borrowing the rest of the buffer: a
    /// [`HostRegion`] of it lent to another thread may be writing other
    /// ranges meanwhile.
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub fn range(&self, range: Range<usize>) -> &[T] {
        self.check(&range);
        // `Vec::as_ptr` makes no reference to the whole vector's elements.
        let start = self
            .values
            .as_ptr()
            .wrapping_add(self.range.start + range.start);
        // SAFETY: within `values` (checked above); a region's holder writes
        // only the ranges handed to it (`HostRegion::range_mut`), never one
        // read here.
        unsafe { std::slice::from_raw_parts(start, range.len()) }
    }

    /// The elements `range`, mutably, without borrowing the rest of the
    /// buffer (see [`HostBuffer::range`]).
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub fn range_mut(&mut self, range: Range<usize>) -> &mut [T] {
        self.check(&range);
        // `Vec::as_mut_ptr` makes no reference to the whole vector's
        // elements, so the ranges lent through a region stay valid.
        let start = self
            .values
            .as_mut_ptr()
            .wrapping_add(self.range.start + range.start);
        // SAFETY: within `values` (checked above); `&mut self` excludes
        // every other borrow of the buffer, and a region's holder touches
        // only the ranges handed to it (`HostRegion::range_mut`), never
        // this one.
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.range.len(),
            "range {range:?} of a host buffer of {}",
            self.range.len()
        );
    }

    /// A [`HostRegion`] over the whole buffer, for another thread to touch
    /// the ranges it is handed while this one goes on with the others.
    pub fn region(&mut self) -> HostRegion<T> {
        HostRegion {
            start: self.values.as_mut_ptr().wrapping_add(self.range.start),
            len: self.range.len(),
        }
    }
}

/// A [`HostBuffer`] lent to another thread for a while: the offload's step
/// thread reads (and averages) each bucket's gradients where they landed,
/// in the host shard, while the calling thread queues the next buckets'
/// copies into other ranges of it. It borrows nothing: whoever makes one
/// keeps the buffer alive and in place while it is used, and hands each
/// range to one thread at a time.
pub struct HostRegion<T> {
    start: *mut T,
    len: usize,
}

// SAFETY: a region is a pointer and a length; the thread it is sent to
// touches only the ranges handed to it, while the buffer is kept alive
// (`HostRegion::range_mut`'s contract), which moves `T`s between threads
// as sending them would.
unsafe impl<T: Send> Send for HostRegion<T> {}

impl<T> HostRegion<T> {
    /// The elements `range` of the buffer.
    ///
    /// # Safety
    /// The buffer is alive and in place, and nothing else reads or writes
    /// `range` while the returned slice lives.
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub unsafe fn range_mut(&mut self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} of a host region of {}",
            self.len
        );
        // SAFETY: within the buffer (checked above), alive and touched by
        // nothing else meanwhile (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.start.add(range.start), range.len()) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        let Some(pin) = self.pin.take() else {
            return;
        };
        if !pin.unlock() {
            // A copy the device never finished may still write here: the
            // memory is leaked rather than freed under it.
            let values = std::mem::take(&mut self.values);
            tracing::warn!(
                bytes = values.len() * std::mem::size_of::<T>(),
                "offload: a copy to or from a page-locked host buffer did not land in time; \
                 its memory is kept, not freed"
            );
            std::mem::forget(values);
        }
    }
}

impl<T> std::ops::Deref for HostBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.values[self.range.clone()]
    }
}

impl<T> std::ops::DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.values[self.range.clone()]
    }
}

impl<T> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.range.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use std::sync::Arc;

    /// A pinned buffer (its elements start past the padding) lent as a
    /// region: another thread writes the ranges handed to it while the
    /// owner writes the rest through `range_mut`, and both land where the
    /// buffer's own view sees them.
    #[test]
    fn a_region_and_the_owner_write_their_own_ranges_of_one_buffer() {
        let mut buffer = HostBuffer::<u32>::pinned(100_000, |_| Ok(None)).expect("no lock");
        let mut region = buffer.region();
        let (handed, ranges) = std::sync::mpsc::channel::<Range<usize>>();
        let other = std::thread::spawn(move || {
            for range in ranges {
                // SAFETY: `buffer` outlives the thread (joined below) and
                // the owner never writes a range it handed over.
                let values = unsafe { region.range_mut(range.clone()) };
                for (v, i) in values.iter_mut().zip(range) {
                    *v = 2 * i as u32;
                }
            }
        });
        for k in 0..10 {
            let range = k * 10_000..(k + 1) * 10_000;
            if k % 2 == 0 {
                handed.send(range).expect("the thread runs");
            } else {
                for (v, i) in buffer.range_mut(range.clone()).iter_mut().zip(range) {
                    *v = 3 * i as u32;
                }
            }
        }
        drop(handed);
        other.join().expect("no panic");
        for (i, v) in buffer.iter().enumerate() {
            let k = i / 10_000;
            assert_eq!(*v, if k % 2 == 0 { 2 } else { 3 } * i as u32, "element {i}");
        }
        assert_eq!(buffer.len(), 100_000);
    }

    #[test]
    #[should_panic(expected = "range 5..11 of a host buffer of 10")]
    fn a_range_past_the_buffer_panics_instead_of_reaching_past_it() {
        let mut buffer = HostBuffer::<f32>::pageable(10);
        let _ = buffer.range_mut(5..11);
    }

    thread_local! {
        /// Elements of [`Counted`] dropped on this thread.
        static DROPPED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[derive(Clone, Default)]
    struct Counted(#[allow(dead_code)] u32);

    impl Drop for Counted {
        fn drop(&mut self) {
            DROPPED.with(|d| d.set(d.get() + 1));
        }
    }

    /// Unlocks by noting how many elements were freed before it; says
    /// whether the memory may go (`landed`).
    struct Lock {
        unlocked: Arc<std::sync::Mutex<Option<usize>>>,
        landed: bool,
    }

    impl HostLock for Lock {
        fn unlock(self: Box<Self>) -> bool {
            *self.unlocked.lock().unwrap() = Some(DROPPED.with(|d| d.get()));
            self.landed
        }
    }

    #[test]
    fn a_pinned_buffer_locks_whole_pages_of_its_own_and_unlocks_before_its_memory_goes() {
        let numel = 1000;
        let mut locked = (0, 0);
        let unlocked = Arc::new(std::sync::Mutex::new(None));
        let lock = Lock {
            unlocked: Arc::clone(&unlocked),
            landed: true,
        };
        let buffer = HostBuffer::<Counted>::pinned(numel, |pages| {
            locked = (pages.as_ptr() as usize, std::mem::size_of_val(pages));
            Ok(Some(Box::new(lock)))
        })
        .unwrap();
        let (at, bytes) = locked;
        assert!(buffer.is_pinned());
        assert_eq!(buffer.len(), numel);
        assert_eq!(
            buffer.as_ptr() as usize,
            at,
            "the buffer starts the locked pages"
        );
        assert_eq!(at % PIN_ALIGN, 0, "locked from a page boundary");
        assert_eq!(bytes % PIN_ALIGN, 0, "whole pages locked");
        assert!(bytes >= numel * std::mem::size_of::<Counted>());
        DROPPED.with(|d| d.set(0));
        drop(buffer);
        assert_eq!(
            *unlocked.lock().unwrap(),
            Some(0),
            "unlocked before any element was freed"
        );
        assert!(DROPPED.with(|d| d.get()) > numel, "the padding goes too");
    }

    #[test]
    fn a_buffer_whose_copy_never_landed_is_kept_not_freed() {
        let unlocked = Arc::new(std::sync::Mutex::new(None));
        let lock = Lock {
            unlocked: Arc::clone(&unlocked),
            landed: false,
        };
        let buffer = HostBuffer::<Counted>::pinned(100, |_| Ok(Some(Box::new(lock)))).unwrap();
        DROPPED.with(|d| d.set(0));
        drop(buffer);
        assert_eq!(*unlocked.lock().unwrap(), Some(0), "unlocking was tried");
        assert_eq!(
            DROPPED.with(|d| d.get()),
            0,
            "memory a copy may still write was freed"
        );
    }

    #[test]
    fn a_lock_that_fails_fails_the_allocation_and_pageable_buffers_lock_nothing() {
        let failed =
            HostBuffer::<f32>::pinned(10, |_| Err(Error::Config("cannot lock host memory".into())));
        assert!(failed.unwrap_err().to_string().contains("cannot lock"));
        let pageable = HostBuffer::<f32>::pageable(10);
        assert!(!pageable.is_pinned());
        assert_eq!(&pageable[..], &[0.0; 10]);
    }
}
