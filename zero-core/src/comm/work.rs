//! The handle of an asynchronous collective.

use crate::Result;

/// A collective in flight. It borrows the collective's buffers for `'a`, so
/// they cannot be touched until it is waited.
///
/// Dropping a `Work` without waiting waits for it (errors are logged).
#[must_use = "an asynchronous collective must be waited before its buffers are used"]
pub struct Work<'a> {
    poll: Option<Box<dyn FnMut(bool) -> Result<bool> + Send + 'a>>,
}

impl<'a> Work<'a> {
    /// Wraps a poll function: `poll(true)` blocks until the collective has
    /// completed and returns `Ok(true)`; `poll(false)` makes what progress it
    /// can without blocking and returns whether it has completed. After it has
    /// returned `Ok(true)` or an error it is not called again.
    pub fn new(poll: impl FnMut(bool) -> Result<bool> + Send + 'a) -> Self {
        Self {
            poll: Some(Box::new(poll)),
        }
    }

    /// A work that has already completed.
    pub fn completed() -> Self {
        Self { poll: None }
    }

    /// Blocks until the collective has completed.
    pub fn wait(mut self) -> Result<()> {
        match self.poll.take() {
            Some(mut poll) => poll(true).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Returns whether the collective has completed, without blocking.
    pub fn test(&mut self) -> Result<bool> {
        let Some(poll) = self.poll.as_mut() else {
            return Ok(true);
        };
        match poll(false) {
            Ok(true) => {
                self.poll = None;
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                self.poll = None;
                Err(e)
            }
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if let Some(mut poll) = self.poll.take() {
            if let Err(e) = poll(true) {
                tracing::warn!("asynchronous collective dropped without wait failed: {e}");
            }
        }
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.poll.is_none())
            .finish()
    }
}
