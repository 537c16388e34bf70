//! A set of disjoint free ranges, kept coalesced, with an optional index by size.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};

/// The start and segment of a free range; the map key is its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u64,
    seg: u32,
}

/// Disjoint free ranges `start..end`, each inside one segment. Adjacent ranges of the same
/// segment are always merged; ranges of different segments never are.
///
/// Ranges are keyed by their **end** address: taking a block from the front of a range (what
/// every policy does) then only changes the value in place, and merging with the range
/// after a freed one too. The size index holds `(len, end)` pairs, so its order is "smallest
/// first, then lowest address".
#[derive(Clone, Debug)]
pub(crate) struct FreeSpace {
    by_end: BTreeMap<u64, Span>,
    by_size: Option<BTreeSet<(u64, u64)>>,
    bytes: u64,
}

/// A free range taken by an allocation: its start became the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) addr: u64,
    pub(crate) seg: u32,
}

impl FreeSpace {
    /// An empty set; `size_index` keeps the `(len, end)` index best-fit and worst-fit need.
    pub(crate) fn new(size_index: bool) -> Self {
        FreeSpace { by_end: BTreeMap::new(), by_size: size_index.then(BTreeSet::new), bytes: 0 }
    }

    /// Number of ranges.
    pub(crate) fn ranges(&self) -> usize {
        self.by_end.len()
    }

    /// Free bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The largest range's length (0 if none): O(log n) with the size index, else a scan.
    pub(crate) fn largest(&self) -> u64 {
        match &self.by_size {
            Some(idx) => idx.last().map_or(0, |&(len, _)| len),
            None => self.by_end.iter().map(|(&end, s)| end - s.start).max().unwrap_or(0),
        }
    }

    /// Ranges in address order, as `(start, end, segment)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.by_end.iter().map(|(&end, s)| (s.start, end, s.seg))
    }

    /// Adds `start..end` of segment `seg`, merging it with adjacent ranges of that segment.
    /// If it overlaps a free range, nothing changes and the first free address inside it
    /// is returned.
    pub(crate) fn insert(&mut self, start: u64, end: u64, seg: u32) -> Result<(), u64> {
        debug_assert!(start < end);
        // One lookup finds both neighbours: the range ending at `start` (if any), then the
        // first range ending after `start`, which overlaps if it begins before `end` and
        // is the neighbour after if it begins at `end`.
        let mut ranges = self.by_end.range_mut(start..);
        let (before, next) = match ranges.next() {
            Some((&e, span)) if e == start => ((span.seg == seg).then_some(span.start), ranges.next()),
            first => (None, first),
        };
        let after = match next {
            Some((_, span)) if span.start < end => return Err(span.start.max(start)),
            Some((&e, span)) if span.start == end && span.seg == seg => Some((e, span)),
            _ => None,
        };
        self.bytes += end - start;
        let merged_start = before.unwrap_or(start);
        let merged_after = match after {
            Some((after_end, span)) => {
                span.start = merged_start;
                index_remove(&mut self.by_size, after_end - end, after_end);
                index_insert(&mut self.by_size, after_end - merged_start, after_end);
                true
            }
            None => false,
        };
        if before.is_some() {
            self.by_end.remove(&start);
            index_remove(&mut self.by_size, start - merged_start, start);
        }
        if !merged_after {
            self.by_end.insert(end, Span { start: merged_start, seg });
            index_insert(&mut self.by_size, end - merged_start, end);
        }
        Ok(())
    }

    /// Takes `start..end` out again; it lies inside one free range. Undoes an
    /// [`insert`](Self::insert) exactly, since ranges are kept maximal.
    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        let (&e, span) = self.by_end.range_mut((Excluded(start), Unbounded)).next().expect("inside a range");
        let (s, seg) = (span.start, span.seg);
        debug_assert!(s <= start && end <= e);
        index_remove(&mut self.by_size, e - s, e);
        if end < e {
            span.start = end;
            index_insert(&mut self.by_size, e - end, e);
        } else {
            self.by_end.remove(&e);
        }
        if s < start {
            self.by_end.insert(start, Span { start: s, seg });
            index_insert(&mut self.by_size, start - s, start);
        }
        self.bytes -= end - start;
    }

    /// Next-fit: the first range from the one containing or following `cursor`, in address
    /// order, wrapping around, that holds `n` bytes; `n` is taken from its front.
    pub(crate) fn take_next_fit(&mut self, n: u64, cursor: u64) -> Option<Taken> {
        let hit = carve_first(self.by_end.range_mut((Excluded(cursor), Unbounded)), n)
            .or_else(|| carve_first(self.by_end.range_mut(..=cursor), n))?;
        Some(self.carved(hit, n))
    }

    /// First-fit: the lowest range that holds `n` bytes.
    pub(crate) fn take_first_fit(&mut self, n: u64) -> Option<Taken> {
        let hit = carve_first(self.by_end.iter_mut(), n)?;
        Some(self.carved(hit, n))
    }

    /// Best-fit: the smallest range that holds `n` bytes, the lowest among equals.
    /// Needs the size index.
    pub(crate) fn take_best_fit(&mut self, n: u64) -> Option<Taken> {
        let idx = self.by_size.as_ref().expect("best-fit needs the size index");
        let &(_, end) = idx.range((n, 0)..).next()?;
        Some(self.take_at(end, n))
    }

    /// Worst-fit: the largest range, the lowest among equals, if it holds `n` bytes.
    /// Needs the size index.
    pub(crate) fn take_worst_fit(&mut self, n: u64) -> Option<Taken> {
        let idx = self.by_size.as_ref().expect("worst-fit needs the size index");
        let &(largest, _) = idx.last()?;
        if largest < n {
            return None;
        }
        let &(_, end) = idx.range((largest, 0)..).next()?;
        Some(self.take_at(end, n))
    }

    /// Takes `n` bytes from the front of the range ending at `end`, which holds them.
    fn take_at(&mut self, end: u64, n: u64) -> Taken {
        let span = self.by_end.get_mut(&end).expect("size index and ranges agree");
        let hit = (span.start, end, span.seg);
        span.start += n;
        self.carved(hit, n)
    }

    /// Bookkeeping after `n` bytes were taken from the front of the range `hit` (its
    /// `(start, end, segment)` before the cut), whose start was already advanced in place.
    fn carved(&mut self, (start, end, seg): (u64, u64, u32), n: u64) -> Taken {
        index_remove(&mut self.by_size, end - start, end);
        if start + n == end {
            self.by_end.remove(&end);
        } else {
            index_insert(&mut self.by_size, end - start - n, end);
        }
        self.bytes -= n;
        Taken { addr: start, seg }
    }
}

/// Advances the start of the first range of `ranges` holding `n` bytes by `n`; returns its
/// `(start, end, segment)` before the cut.
fn carve_first<'a>(ranges: impl Iterator<Item = (&'a u64, &'a mut Span)>, n: u64) -> Option<(u64, u64, u32)> {
    for (&end, span) in ranges {
        if end - span.start >= n {
            let hit = (span.start, end, span.seg);
            span.start += n;
            return Some(hit);
        }
    }
    None
}

fn index_insert(idx: &mut Option<BTreeSet<(u64, u64)>>, len: u64, end: u64) {
    if let Some(idx) = idx {
        idx.insert((len, end));
    }
}

fn index_remove(idx: &mut Option<BTreeSet<(u64, u64)>>, len: u64, end: u64) {
    if let Some(idx) = idx {
        idx.remove(&(len, end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(f: &FreeSpace) -> Vec<(u64, u64, u32)> {
        f.iter().collect()
    }

    #[test]
    fn insert_coalesces_within_a_segment_only() {
        for indexed in [false, true] {
            let mut f = FreeSpace::new(indexed);
            for (start, end, seg) in [(0, 8, 0), (16, 24, 0), (8, 16, 0)] {
                f.insert(start, end, seg).expect("disjoint"); // the last bridges both
            }
            assert_eq!(ranges(&f), [(0, 24, 0)]);
            for (start, end, seg) in [(24, 32, 1), (40, 48, 1), (32, 40, 1)] {
                f.insert(start, end, seg).expect("disjoint"); // adjacent, other segment
            }
            assert_eq!(ranges(&f), [(0, 24, 0), (24, 48, 1)]);
            assert_eq!((f.bytes(), f.largest(), f.ranges()), (48, 24, 2));
        }
    }

    #[test]
    fn overlapping_inserts_are_refused_and_removal_undoes_insertion() {
        for indexed in [false, true] {
            let mut f = FreeSpace::new(indexed);
            f.insert(16, 32, 0).expect("disjoint");
            f.insert(64, 96, 0).expect("disjoint");
            let before = ranges(&f);
            assert_eq!(f.insert(8, 24, 0), Err(16));
            assert_eq!(f.insert(20, 24, 0), Err(20));
            assert_eq!(f.insert(24, 72, 0), Err(24));
            assert_eq!(f.insert(32, 72, 0), Err(64));
            assert_eq!(ranges(&f), before);
            // Every way an insertion can merge, undone.
            for (start, end) in [(32, 64), (8, 16), (96, 104), (40, 48), (0, 8), (104, 112)] {
                let (bytes, largest) = (f.bytes(), f.largest());
                let snapshot = ranges(&f);
                f.insert(start, end, 0).expect("disjoint");
                f.remove(start, end);
                assert_eq!((ranges(&f), f.bytes(), f.largest()), (snapshot, bytes, largest));
                if let Some(idx) = &f.by_size {
                    let lens: Vec<(u64, u64)> = f.iter().map(|(s, e, _)| (e - s, e)).collect();
                    assert_eq!(idx.len(), lens.len());
                    assert!(lens.iter().all(|l| idx.contains(l)));
                }
            }
        }
    }

    #[test]
    fn carving_keeps_the_index_in_step() {
        let mut f = FreeSpace::new(true);
        f.insert(0, 64, 0).expect("disjoint");
        f.insert(100, 132, 0).expect("disjoint");
        assert_eq!(f.take_best_fit(32), Some(Taken { addr: 100, seg: 0 }));
        assert_eq!(ranges(&f), [(0, 64, 0)]);
        assert_eq!(f.take_worst_fit(16), Some(Taken { addr: 0, seg: 0 }));
        assert_eq!(f.take_worst_fit(64), None);
        assert_eq!(f.by_size.as_ref().map(|i| i.iter().copied().collect::<Vec<_>>()), Some(vec![(48, 64)]));
        assert_eq!(f.take_first_fit(48), Some(Taken { addr: 16, seg: 0 }));
        assert!(f.ranges() == 0 && f.by_size.as_ref().is_some_and(BTreeSet::is_empty));
        assert_eq!(f.bytes(), 0);
    }
}
