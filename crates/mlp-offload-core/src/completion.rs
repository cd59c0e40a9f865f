//! The handle a caller waits on or polls: one logical operation made of any number of parts (chunks on
//! several paths), carrying its own status and keeping its buffers alive until every part is done.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::error::{Error, Result};

type Finisher = Box<dyn FnOnce(Result<()>) -> Result<()> + Send>;

/// A cloneable handle on one operation. Parts report with [`Completion::part_done`]; when the last one
/// has, the finisher runs (with the combined status), the kept-alive values are dropped, and waiters wake.
#[derive(Clone)]
pub struct Completion {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    done_cond: Condvar,
}

struct State {
    /// Parts not yet done, plus one for the builder until [`Completion::seal`].
    pending: usize,
    first_error: Option<Error>,
    outcome: Option<Result<()>>,
    finisher: Option<Finisher>,
    keepalive: Vec<Box<dyn Any + Send>>,
    waker: Option<Waker>,
}

impl Default for Completion {
    fn default() -> Self {
        Self::new()
    }
}

impl Completion {
    /// An open completion: add parts, then [`seal`](Self::seal) it.
    pub fn new() -> Self {
        Completion {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    pending: 1,
                    first_error: None,
                    outcome: None,
                    finisher: None,
                    keepalive: Vec::new(),
                    waker: None,
                }),
                done_cond: Condvar::new(),
            }),
        }
    }

    /// A completion that is already finished with `result`.
    pub fn finished(result: Result<()>) -> Self {
        let c = Completion::new();
        c.part_done(result);
        c
    }

    /// Registers one more part that will report through [`part_done`](Self::part_done).
    pub fn add_part(&self) {
        let mut st = self.lock();
        assert!(st.outcome.is_none(), "part added to a finished completion");
        st.pending += 1;
    }

    /// Runs `finisher` with the combined status once every part is done; its result is the outcome.
    pub fn set_finisher(&self, finisher: impl FnOnce(Result<()>) -> Result<()> + Send + 'static) {
        self.lock().finisher = Some(Box::new(finisher));
    }

    /// Keeps `value` (a buffer's owner) alive until every part is done.
    pub fn keep_alive(&self, value: Box<dyn Any + Send>) {
        self.lock().keepalive.push(value);
    }

    /// Ends the adding of parts; the completion can finish from now on.
    pub fn seal(&self) {
        self.part_done(Ok(()));
    }

    /// Reports one part's status; the first error wins.
    pub fn part_done(&self, result: Result<()>) {
        let (finisher, combined, keepalive) = {
            let mut st = self.lock();
            if let Err(e) = result {
                st.first_error.get_or_insert(e);
            }
            st.pending -= 1;
            if st.pending > 0 {
                return;
            }
            let combined = match st.first_error.take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            (
                st.finisher.take(),
                combined,
                std::mem::take(&mut st.keepalive),
            )
        };
        // The finisher runs outside the lock: it may take other locks (the store's object table).
        let outcome = match finisher {
            Some(f) => f(combined),
            None => combined,
        };
        // Every byte has moved: the buffers' owners may go now.
        drop(keepalive);
        let waker = {
            let mut st = self.lock();
            st.outcome = Some(outcome);
            st.waker.take()
        };
        self.shared.done_cond.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Whether every part is done (the outcome is then available without blocking).
    pub fn is_done(&self) -> bool {
        self.lock().outcome.is_some()
    }

    /// Blocks until done and returns the outcome (again on every call).
    pub fn wait(&self) -> Result<()> {
        let mut st = self.lock();
        while st.outcome.is_none() {
            st = self.shared.done_cond.wait(st).expect("completion lock");
        }
        clone_outcome(st.outcome.as_ref().expect("checked above"))
    }

    /// Like [`wait`](Self::wait) with a limit; `None` when it is not done in time.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let st = self.lock();
        let (st, _) = self
            .shared
            .done_cond
            .wait_timeout_while(st, timeout, |s| s.outcome.is_none())
            .expect("completion lock");
        st.outcome.as_ref().map(clone_outcome)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().expect("completion lock")
    }
}

fn clone_outcome(r: &Result<()>) -> Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(e) => Err(e.duplicate()),
    }
}

/// Completions compose with async orchestration (tokio or any executor); the data path never needs it.
impl Future for Completion {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = self.lock();
        match &st.outcome {
            Some(r) => Poll::Ready(clone_outcome(r)),
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn finishes_only_after_seal_and_every_part() {
        let c = Completion::new();
        c.add_part();
        c.add_part();
        c.part_done(Ok(()));
        c.part_done(Ok(()));
        assert!(!c.is_done(), "not sealed yet");
        c.seal();
        assert!(c.is_done());
        assert!(c.wait().is_ok());
    }

    #[test]
    fn first_error_wins_and_finisher_sees_it() {
        let c = Completion::new();
        c.add_part();
        c.add_part();
        c.set_finisher(|r| {
            assert!(r.is_err());
            r
        });
        c.seal();
        c.part_done(Err(Error::config("first", "x")));
        c.part_done(Err(Error::config("second", "y")));
        let err = c.wait().unwrap_err();
        assert!(err.to_string().starts_with("first"), "{err}");
    }

    #[test]
    fn keepalive_is_dropped_when_done() {
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let c = Completion::new();
        c.add_part();
        c.keep_alive(Box::new(Flag(dropped.clone())));
        c.seal();
        assert!(!dropped.load(Ordering::SeqCst));
        c.part_done(Ok(()));
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn can_be_awaited() {
        let c = Completion::new();
        c.add_part();
        let c2 = c.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c2.part_done(Ok(()));
        });
        c.seal();
        c.await.unwrap();
    }
}
