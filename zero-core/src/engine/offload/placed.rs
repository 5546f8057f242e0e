//! Where an offloading memory's buffers are ([`Placed`]), and the moves
//! that run a device operation over buffers wherever they are.

use crate::comm::Communicator;
use crate::engine::host_buffer::HostBuffer;
use crate::engine::{HostTransfers, ParamCopy};
use crate::{Element, Error, Result};
use std::ops::Range;

/// A buffer of [`OffloadMemory`](super::OffloadMemory): in device memory `B`, or offloaded to
/// host memory.
#[derive(Debug)]
pub enum Placed<B, T> {
    /// On the device.
    Device(B),
    /// Offloaded to host memory.
    Host(HostBuffer<T>),
}

/// The span of buffer positions `[at, at + len)` of every item.
pub(super) fn span(items: impl Iterator<Item = (usize, usize)>) -> Range<usize> {
    let mut span: Option<Range<usize>> = None;
    for (at, len) in items {
        let (lo, hi) = span.map_or((at, at + len), |s| (s.start.min(at), s.end.max(at + len)));
        span = Some(lo..hi);
    }
    span.unwrap_or(0..0)
}

/// The copies with their buffer positions shifted down by `by`.
pub(super) fn shifted(copies: &[ParamCopy], by: usize) -> Vec<ParamCopy> {
    copies
        .iter()
        .map(|c| ParamCopy {
            at: c.at - by,
            ..c.clone()
        })
        .collect()
}

pub(super) fn internal(what: &str) -> Error {
    Error::State(format!("internal: offload: {what}"))
}

/// `buffer[range]` in device memory: the buffer itself, or a device copy
/// of a host buffer's range (then at `0..len`).
pub(super) fn staged_up<T: Element, C: Communicator, D: HostTransfers<T, C>>(
    device: &mut D,
    buffer: &Placed<D::Buffer, T>,
    range: Range<usize>,
) -> Result<Option<D::Buffer>> {
    match buffer {
        Placed::Device(_) => Ok(None),
        Placed::Host(values) => upload(device, values, range).map(Some),
    }
}

/// A device buffer holding `values[range]`: only queued from page-locked
/// memory.
pub(super) fn upload<T: Element, C: Communicator, D: HostTransfers<T, C>>(
    device: &mut D,
    values: &HostBuffer<T>,
    range: Range<usize>,
) -> Result<D::Buffer> {
    if values.is_pinned() {
        // SAFETY: `values` is locked by this device's `pin_host` (whose unlock
        // waits for queued copies), its length is fixed, and nothing writes
        // `range` on the host before the copy lands: `OffloadMemory` lands
        // before it writes host memory (`land_for`), and the step thread
        // writes no bucket of either shard (the parameters, or the weights
        // packed in the gradients' place) after reporting it stepped, until
        // a landing taken once the bucket was reduced in the next pass,
        // behind this copy.
        unsafe { device.upload_queued(values.range(range)) }
    } else {
        let mut staged = device.alloc_zeroed(range.len())?;
        device.buffer_from_host(&mut staged, 0, values.range(range))?;
        Ok(staged)
    }
}

/// Runs the device collective `op(device, send, send_range, recv,
/// recv_range)` over buffers wherever they are: host ranges are staged
/// on the device, and a host `recv` gets the result back.
pub(super) fn collective<T: Element, C: Communicator, D: HostTransfers<T, C>>(
    device: &mut D,
    send: &Placed<D::Buffer, T>,
    send_range: Range<usize>,
    recv: &mut Placed<D::Buffer, T>,
    recv_range: Range<usize>,
    op: impl FnOnce(&mut D, &D::Buffer, Range<usize>, &mut D::Buffer, Range<usize>) -> Result<()>,
) -> Result<()> {
    let staged_send = staged_up(device, send, send_range.clone())?;
    let (send, send_range) = match (&staged_send, send) {
        (Some(staged), _) => (staged, 0..send_range.len()),
        (None, Placed::Device(send)) => (send, send_range),
        (None, Placed::Host(_)) => return Err(internal("host send not staged")),
    };
    match recv {
        Placed::Device(recv) => op(device, send, send_range, recv, recv_range),
        Placed::Host(values) => {
            let n = recv_range.len();
            let mut staged = device.alloc_zeroed(n)?;
            op(device, send, send_range, &mut staged, 0..n)?;
            if values.is_pinned() {
                // SAFETY: `values` is locked by this device's `pin_host`
                // (whose unlock waits for queued copies), its length is fixed,
                // and `OffloadMemory` lands before it touches host memory
                // (`land_for`), as the engine does before it reads a host
                // shard itself; the offload's step thread reads a bucket
                // only after a landing taken once its copy was queued.
                unsafe { device.download_queued(staged, 0..n, values.range_mut(recv_range)) }
            } else {
                device.download(&staged, 0..n, values.range_mut(recv_range))
            }
        }
    }
}

/// Runs the device all-reduce `op` over `buffer[range]` wherever it is.
pub(super) fn all_reduce_placed<T: Element, C: Communicator, D: HostTransfers<T, C>>(
    device: &mut D,
    buffer: &mut Placed<D::Buffer, T>,
    range: Range<usize>,
    op: impl FnOnce(&mut D, &mut D::Buffer, Range<usize>) -> Result<()>,
) -> Result<()> {
    match buffer {
        Placed::Device(b) => op(device, b, range),
        Placed::Host(values) => {
            let n = range.len();
            let mut staged = device.alloc_zeroed(n)?;
            device.buffer_from_host(&mut staged, 0, &values[range.clone()])?;
            op(device, &mut staged, 0..n)?;
            device.download(&staged, 0..n, &mut values[range])
        }
    }
}

/// `buffer` whole in host memory: itself, or a downloaded copy.
pub(super) fn host_copy_of<T: Element, C: Communicator, D: HostTransfers<T, C>>(
    device: &mut D,
    buffer: &Placed<D::Buffer, T>,
) -> Result<Option<Vec<T>>> {
    match buffer {
        Placed::Host(_) => Ok(None),
        Placed::Device(b) => {
            let n = D::buffer_len(b);
            let mut values = vec![T::default(); n];
            device.download(b, 0..n, &mut values)?;
            Ok(Some(values))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_covers_every_item_and_nothing_before_the_first() {
        assert_eq!(span([(8, 4), (2, 3), (20, 0)].into_iter()), 2..20);
        assert_eq!(span(std::iter::empty()), 0..0);
    }
}
