//! The segments of one heap, looked up by address.

use std::collections::BTreeMap;

use super::{HeapError, RemoteRegion};

/// Segments in the order they were added (their index is their name on the wire), plus an
/// index by base address. Segments never overlap.
#[derive(Clone, Debug, Default)]
pub(crate) struct SegmentTable {
    segs: Vec<RemoteRegion>,
    by_base: BTreeMap<u64, u32>,
    total: u64,
}

impl SegmentTable {
    /// Adds `seg`, whose base and length must be multiples of `align`; returns its index.
    pub(crate) fn add(&mut self, seg: RemoteRegion, align: u64) -> Result<u32, HeapError> {
        let invalid = HeapError::InvalidSegment { base: seg.addr, len: seg.len };
        let Some(end) = seg.end() else { return Err(invalid) };
        if seg.len == 0 || !seg.addr.is_multiple_of(align) || !seg.len.is_multiple_of(align) {
            return Err(invalid);
        }
        let overlap = HeapError::SegmentOverlap { base: seg.addr, len: seg.len };
        if let Some((_, &i)) = self.by_base.range(..end).next_back()
            && self.segs[i as usize].addr + self.segs[i as usize].len > seg.addr
        {
            return Err(overlap);
        }
        let index = u32::try_from(self.segs.len()).map_err(|_| HeapError::TooManySegments)?;
        self.segs.push(seg);
        self.by_base.insert(seg.addr, index);
        self.total += seg.len;
        Ok(index)
    }

    pub(crate) fn get(&self, index: u32) -> Option<&RemoteRegion> {
        self.segs.get(index as usize)
    }

    /// The segment holding all of `addr..end` (`addr < end`).
    pub(crate) fn find(&self, addr: u64, end: u64) -> Option<u32> {
        if self.segs.len() <= 4 {
            let i = self.segs.iter().position(|s| s.addr <= addr && end <= s.addr + s.len)?;
            return Some(i as u32);
        }
        let (_, &i) = self.by_base.range(..=addr).next_back()?;
        let seg = &self.segs[i as usize];
        (end <= seg.addr + seg.len).then_some(i)
    }

    pub(crate) fn as_slice(&self) -> &[RemoteRegion] {
        &self.segs
    }

    pub(crate) fn len(&self) -> usize {
        self.segs.len()
    }

    /// Bytes in all segments (segments are disjoint and end at most at `u64::MAX`, so this
    /// cannot overflow).
    pub(crate) fn total(&self) -> u64 {
        self.total
    }
}
