//! How the [`Fetcher`] issues, waits for and lets go of gathers: the
//! decisions every rank takes alike (the rules are in the `fetch` module's
//! documentation).

use super::board::{Issued, Phase, State};
use super::fetcher::Fetcher;
use super::memory::GatherMemory;
use super::worker::gather_unit;
use crate::{Error, Result};
use std::sync::{MutexGuard, PoisonError};

impl<T: crate::Element, G: GatherMemory<T>> Fetcher<T, G> {
    /// Records a request for `unit` in this pass's log: a new forward when
    /// it starts one again, the backward's gathers allowed ahead when it
    /// ends the forward.
    pub(super) fn note_request<'s>(
        &'s self,
        mut st: MutexGuard<'s, State<G::Buffer>>,
        unit: usize,
    ) -> Result<MutexGuard<'s, State<G::Buffer>>> {
        // Once the forward went on into the backward's upcoming units,
        // nothing upcoming is for this forward any more.
        let expected = !st.continued
            && (st.upcoming.contains(&unit) || st.issued.iter().any(|i| i.unit == unit));
        let starts_a_pass =
            st.forward_trace.first() == Some(&unit) || st.log.first() == Some(&unit);
        if st.phase == Phase::Forward && !st.log.is_empty() && starts_a_pass && !expected {
            // The first layer of the trace (or of this pass) again, with no
            // backward in between and nothing upcoming for it: a new forward
            // (after an evaluation pass).
            st = self.restart_forward(st)?;
        }
        st.log.push(unit);
        if st.phase == Phase::Forward && !st.continued && st.log == st.forward_trace {
            // The forward's last request: the backward's first gathers may
            // go ahead now (its first layer is usually this one).
            if let Some(trace) = &st.backward_trace {
                let trace = trace.clone();
                st.upcoming.extend(trace);
                st.continued = true;
            }
        }
        Ok(st)
    }

    /// Waits for the gather of `ticket` (of `unit`) and takes its buffer,
    /// ready for the caller's stream.
    pub(super) fn take_gathered(
        &self,
        st: MutexGuard<'_, State<G::Buffer>>,
        ticket: u64,
        unit: usize,
    ) -> Result<G::Buffer> {
        let mut st = self
            .board
            .done
            .wait_while(st, |st| {
                st.issued
                    .iter()
                    .any(|i| i.ticket == ticket && i.result.is_none())
            })
            .unwrap_or_else(PoisonError::into_inner);
        let j = st
            .issued
            .iter()
            .position(|i| i.ticket == ticket)
            .ok_or_else(|| Error::State("internal: a gather vanished".into()))?;
        let issued = st.issued.remove(j).expect("position found above");
        let bytes = self.bytes(unit);
        st.ahead_bytes -= bytes;
        let ready = match issued.result {
            Some(Ok(mut buffer)) => match self.gathers.ready(&mut buffer) {
                Ok(()) => Ok(buffer),
                Err(e) => {
                    st.pool.push(buffer);
                    Err(e)
                }
            },
            Some(Err(e)) => Err(e),
            None => Err(Error::State("internal: a gather had no result".into())),
        };
        if ready.is_err() {
            st.live_bytes -= bytes;
        }
        ready
    }

    pub(super) fn bytes(&self, unit: usize) -> usize {
        self.units[unit].len * self.elem_bytes
    }

    /// Issues the gather of `unit` (the caller decided, on every rank alike).
    pub(super) fn issue(&self, st: &mut State<G::Buffer>, unit: usize) -> u64 {
        let len = self.units[unit].len;
        // The smallest pooled buffer that holds the unit, else the largest
        // one grown (so the pool never holds more buffers than were alive
        // at once), else a new one.
        let fits = st
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| G::capacity(b) >= len)
            .min_by_key(|(_, b)| G::capacity(b))
            .map(|(i, _)| i);
        let largest = || {
            st.pool
                .iter()
                .enumerate()
                .max_by_key(|(_, b)| G::capacity(b))
                .map(|(i, _)| i)
        };
        let reuse = fits.or_else(largest).map(|i| st.pool.swap_remove(i));
        let buffer = self.gathers.buffer(reuse, len);
        let bytes = self.bytes(unit);
        st.live_bytes += bytes;
        st.ahead_bytes += bytes;
        st.stats.peak_live_bytes = st.stats.peak_live_bytes.max(st.live_bytes);
        for &p in &self.members[unit] {
            st.stats.gathers[p] += 1;
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let result = match (buffer, &self.jobs) {
            (Err(e), _) => Some(Err(e)),
            (Ok(buffer), Some(jobs)) => {
                let sent = jobs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .send((ticket, unit, buffer));
                match sent {
                    Ok(()) => None,
                    Err(_) => Some(Err(Error::State(
                        "stage 3: the gather thread is gone (it panicked?)".into(),
                    ))),
                }
            }
            (Ok(buffer), None) => Some(gather_unit(
                &*self.gathers,
                &self.units[unit],
                &self.shard,
                buffer,
            )),
        };
        st.issued.push_back(Issued {
            unit,
            result,
            ticket,
        });
        ticket
    }

    /// Issues upcoming units while the budgets allow (when gathers overlap
    /// the caller's work: a blocking gather ahead on the caller's thread
    /// would only hold memory longer).
    pub(super) fn top_up(&self, st: &mut State<G::Buffer>) {
        if !self.overlaps() {
            return;
        }
        while let Some(&unit) = st.upcoming.front() {
            let bytes = self.bytes(unit);
            // One unit may always run ahead (when prefetching at all), or
            // a layer larger than the budget would never be prefetched.
            let ahead_full = self.prefetch_bytes == 0
                || (st.ahead_bytes > 0 && st.ahead_bytes + bytes > self.prefetch_bytes);
            if ahead_full || st.live_bytes + bytes > self.max_live_bytes {
                break;
            }
            st.upcoming.pop_front();
            self.issue(st, unit);
        }
    }

    /// Makes room for `unit` under `max_live_bytes` by dropping the most
    /// recently issued prefetches (they go back to the front of the upcoming units).
    pub(super) fn make_room<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<G::Buffer>>,
        unit: usize,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let bytes = self.bytes(unit);
        while st.live_bytes + bytes > self.max_live_bytes {
            let Some(last) = st.issued.back().map(|i| i.ticket) else {
                return Err(Error::Config(format!(
                    "stage 3: {} gathered bytes are in use and the next layer needs {bytes} more, \
                     beyond max_live_bytes ({}); raise max_live_bytes",
                    st.live_bytes, self.max_live_bytes
                )));
            };
            st = self.wait_for(st, last);
            let dropped = st.issued.pop_back().expect("waited for it above");
            let dropped_bytes = self.bytes(dropped.unit);
            st.ahead_bytes -= dropped_bytes;
            st.live_bytes -= dropped_bytes;
            st.upcoming.push_front(dropped.unit);
            match dropped.result {
                Some(Ok(buffer)) => self.pool(&mut st, buffer)?,
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        Ok(st)
    }

    fn wait_for<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
        ticket: u64,
    ) -> MutexGuard<'a, State<G::Buffer>> {
        self.board
            .done
            .wait_while(st, |st| {
                st.issued
                    .iter()
                    .any(|i| i.ticket == ticket && i.result.is_none())
            })
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts a gathered buffer that no request took back in the pool, once
    /// what follows is ordered after its gather (a step may change the
    /// shard it reads).
    fn pool(&self, st: &mut State<G::Buffer>, mut buffer: G::Buffer) -> Result<()> {
        let ready = self.gathers.ready(&mut buffer);
        st.pool.push(buffer);
        ready
    }

    /// Waits for every issued gather and puts its buffer back in the pool.
    pub(super) fn drain<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let mut st = self
            .board
            .done
            .wait_while(st, |st| st.issued.iter().any(|i| i.result.is_none()))
            .unwrap_or_else(PoisonError::into_inner);
        let mut first_error = None;
        while let Some(issued) = st.issued.pop_front() {
            let bytes = self.bytes(issued.unit);
            st.ahead_bytes -= bytes;
            st.live_bytes -= bytes;
            let pooled = match issued.result {
                Some(Ok(buffer)) => self.pool(&mut st, buffer),
                Some(Err(e)) => Err(e),
                None => Ok(()),
            };
            if let Err(e) = pooled {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(st),
        }
    }

    /// A new forward pass without a backward since the last one.
    fn restart_forward<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let mut st = self.drain(st)?;
        st.continued = false;
        let log = std::mem::take(&mut st.log);
        if log != st.forward_trace {
            st.stats.retraces += 1;
            st.forward_trace = log;
        }
        st.upcoming = st.forward_trace.iter().copied().collect();
        Ok(st)
    }
}
