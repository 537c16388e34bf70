//! Many small atomic counters sub-allocated from one MEMIC region.
//!
//! Device memory is small (128–256 KiB) and every allocation takes at least 64 bytes, so
//! one allocation per counter would waste most of it; a pool hands out 8-byte slots of one
//! region instead.

use std::sync::{Arc, Mutex};

use rdmakit_verbs::{Error, LocalSlice, RemoteSlice, Result};

use super::{Location, Memic, MemicRegion, Placement};

/// A pool of 8-byte counters in one MEMIC region.
#[derive(Clone, Debug)]
pub struct CounterPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    region: MemicRegion,
    /// Free slot indices (a stack: the most recently freed is reused first).
    free: Mutex<Vec<u32>>,
}

/// One counter: 8 bytes of a pool's region, returned to the pool on drop.
#[derive(Debug)]
pub struct Counter {
    pool: Arc<PoolInner>,
    slot: u32,
}

impl CounterPool {
    /// A pool of at least `count` counters, in one region placed as `placement` says.
    pub fn new(memic: &Memic, count: u32, placement: Placement) -> Result<CounterPool> {
        if count == 0 {
            return Err(Error::InvalidArgument("a counter pool needs at least one counter".into()));
        }
        let region = memic.alloc(u64::from(count) * 8, placement)?;
        let slots = u32::try_from(region.len() / 8).unwrap_or(u32::MAX);
        let free = Mutex::new((0..slots).rev().collect());
        Ok(CounterPool { inner: Arc::new(PoolInner { region, free }) })
    }

    /// Where the counters live.
    pub fn location(&self) -> Location {
        self.inner.region.location()
    }

    /// The region holding the counters.
    pub fn region(&self) -> &MemicRegion {
        &self.inner.region
    }

    /// Counters still free.
    pub fn available(&self) -> usize {
        self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Takes a free counter, set to zero; `None` when all are in use.
    pub fn alloc(&self) -> Result<Option<Counter>> {
        let slot = self.inner.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let Some(slot) = slot else { return Ok(None) };
        let c = Counter { pool: self.inner.clone(), slot };
        c.set(0)?;
        Ok(Some(c))
    }
}

impl Counter {
    fn offset(&self) -> u64 {
        u64::from(self.slot) * 8
    }

    /// The counter as a remote atomic target (8 bytes).
    pub fn remote(&self) -> Result<RemoteSlice> {
        self.pool.region.remote().slice(self.offset(), 8)
    }

    /// The counter as a local buffer (for example as an atomic's result buffer).
    pub fn local(&self) -> Result<LocalSlice> {
        self.pool.region.slice(self.offset(), 8)
    }

    /// The current value (a copy, native-endian as atomics leave it).
    pub fn get(&self) -> Result<u64> {
        self.pool.region.read_u64(self.offset())
    }

    /// Sets the value.
    pub fn set(&self, v: u64) -> Result<()> {
        self.pool.region.write_u64(self.offset(), v)
    }

    /// The slot index in the pool's region.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.slot);
    }
}
