//! A set of disjoint free ranges, kept coalesced, with an optional index by size (best-fit,
//! worst-fit) or by size class and address (first-fit).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};

use super::addr_index::AddrIndex;

/// The start and segment of a free range, in the [`FreeSpace`]'s arena; the range's end is
/// its key in the address map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u64,
    seg: u32,
}

/// Disjoint free ranges `start..end`, each inside one segment. Adjacent ranges of the same
/// segment are always merged; ranges of different segments never are.
///
/// Each range lives in a slot of an arena (`start` and segment); the address map takes a
/// range's **end** to its slot, and the size index holds `(len, end, slot)` entries. Taking
/// a block from the front of a range (what every policy does) then changes only its slot
/// (the end, and so the map, stay as they are): best-fit and worst-fit find the range in
/// the size index and carve it without searching the address map at all; only a range
/// used up or freed touches the map. Next-fit walks the map in address order from its
/// cursor, unless the range its last take left behind starts at the cursor (as it does
/// between frees): it takes from that one, found without a search; first-fit
/// asks the address index ([`AddrIndex`]): size classes in address order under a
/// two-level table of their lowest addresses.
#[derive(Clone, Debug)]
pub(crate) struct FreeSpace {
    /// End address → slot in `arena`.
    by_end: BTreeMap<u64, usize>,
    /// The ranges' starts and segments; slots of merged or used-up ranges are `vacant`.
    arena: Vec<Span>,
    /// Free slots of `arena`, reused first: the arena never holds more slots than the most
    /// ranges there ever were at once.
    vacant: Vec<usize>,
    by_size: Option<SizeIndex>,
    by_addr: Option<AddrIndex>,
    bytes: u64,
    /// The range next-fit last carved from and left non-empty, as (end, slot), until any
    /// other change of the ranges: it starts where that allocation ended, so when the next
    /// one starts there too (the allocator's cursor), it is the first range the search
    /// would look at, found without a search of the map.
    hint: Option<(u64, usize)>,
}

/// Which index a [`FreeSpace`] keeps beside its address map, for the policy it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexKind {
    /// None: next-fit walks the address map from its cursor.
    None,
    /// By size, for best-fit and worst-fit.
    Size,
    /// By size class and address, for first-fit.
    Address,
}

/// Lengths below this have an exact-size bin each in the [`SizeIndex`].
const EXACT: u64 = 1 << SUB_BITS;
/// Each power of two from [`EXACT`] up is split into `2^SUB_BITS` bins of equal width.
const SUB_BITS: u32 = 4;
/// Number of bins: the exact ones, then `2^SUB_BITS` per power of two from `EXACT` to 2^63.
pub(super) const BINS: usize = EXACT as usize + (64 - SUB_BITS as usize) * (1 << SUB_BITS);
/// Words of the bitmap of non-empty bins.
const WORDS: usize = BINS.div_ceil(64);
/// Most entries a bin keeps in a sorted vector; a bin that grows beyond becomes a B-tree
/// set (and a set that shrinks to half of it a vector again).
const BIN_VEC: usize = 32;

/// The bin of ranges of `len` bytes: two-level segregated fit (TLSF). Lengths below
/// [`EXACT`] have a bin each; above, the position of the highest set bit picks a power of
/// two and the next [`SUB_BITS`] bits one of its equal parts. Monotone: a longer range never
/// sits in a lower bin, so every range in a bin above `bin_of(n)` holds at least `n` bytes.
pub(super) fn bin_of(len: u64) -> usize {
    if len < EXACT {
        return len as usize;
    }
    let top = 63 - len.leading_zeros(); // >= SUB_BITS
    let sub = (len >> (top - SUB_BITS)) & (EXACT - 1);
    EXACT as usize + (top - SUB_BITS) as usize * (1 << SUB_BITS) + sub as usize
}

/// A size index entry: a free range of `len` bytes ending at `end`, in arena slot `slot`.
/// Ordered, and equal, by length then address ([`key`](Self::key)); ends of disjoint
/// ranges are distinct, so two entries of one index never differ by their slot alone.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    len: u64,
    end: u64,
    slot: usize,
}

impl Entry {
    /// Below every entry of `len` bytes or more.
    const fn floor(len: u64) -> Entry {
        Entry { len, end: 0, slot: 0 }
    }

    /// Length and end as one number: the bins' searches compare it in one step, with no
    /// branch on whether the lengths were equal.
    fn key(&self) -> u128 {
        u128::from(self.len) << 64 | u128::from(self.end)
    }
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

/// The entries of one bin in order: a sorted vector while it is short (the usual case: an
/// insertion or removal is a short search and move, with no tree to walk), a B-tree set
/// once it grows past [`BIN_VEC`] entries, so that every operation stays O(log n) however
/// many ranges of one size class a peer's frees create.
#[derive(Clone, Debug)]
pub(super) enum Bin<T = Entry> {
    Few(Vec<T>),
    Many(BTreeSet<T>),
}

impl<T: Ord + Copy> Bin<T> {
    pub(super) const EMPTY: Self = Bin::Few(Vec::new());

    pub(super) fn insert(&mut self, e: T) {
        match self {
            Bin::Few(v) => {
                let Err(i) = v.binary_search(&e) else { return };
                if v.len() < BIN_VEC {
                    v.insert(i, e);
                } else {
                    let mut set: BTreeSet<T> = v.drain(..).collect();
                    set.insert(e);
                    *self = Bin::Many(set);
                }
            }
            Bin::Many(set) => {
                set.insert(e);
            }
        }
    }

    pub(super) fn remove(&mut self, e: T) {
        match self {
            Bin::Few(v) => {
                let found = v.binary_search(&e);
                debug_assert!(found.is_ok(), "removing an entry the bin does not hold");
                if let Ok(i) = found {
                    v.remove(i);
                }
            }
            Bin::Many(set) => {
                let found = set.remove(&e);
                debug_assert!(found, "removing an entry the bin does not hold");
                if set.len() <= BIN_VEC / 2 {
                    *self = Bin::Few(std::mem::take(set).into_iter().collect());
                }
            }
        }
    }

    pub(super) fn first(&self) -> Option<T> {
        match self {
            Bin::Few(v) => v.first().copied(),
            Bin::Many(set) => set.first().copied(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        match self {
            Bin::Few(v) => v.is_empty(),
            Bin::Many(set) => set.is_empty(),
        }
    }

    /// Replaces `old` by `new`, which sorts where `old` did (in a vector, in place).
    pub(super) fn replace(&mut self, old: T, new: T) {
        match self {
            Bin::Few(v) => {
                let found = v.binary_search(&old);
                debug_assert!(found.is_ok(), "replacing an entry the bin does not hold");
                if let Ok(i) = found {
                    v[i] = new;
                }
            }
            Bin::Many(set) => {
                let found = set.remove(&old);
                debug_assert!(found, "replacing an entry the bin does not hold");
                set.insert(new);
            }
        }
    }

    /// Replaces `old` by `new`, which may sort elsewhere: in a vector, the entries between
    /// the two places shift by one (one move, where a removal and an insertion make two).
    pub(super) fn reorder(&mut self, old: T, new: T) {
        match self {
            Bin::Few(v) => {
                let found = v.binary_search(&old);
                debug_assert!(found.is_ok(), "reordering an entry the bin does not hold");
                let Ok(i) = found else { return };
                // Where `new` goes among the others: `old` is at `i`, so search either side.
                if new > old {
                    let j = i + v[i + 1..].partition_point(|x| *x < new);
                    v.copy_within(i + 1..=j, i);
                    v[j] = new;
                } else {
                    let j = v[..i].partition_point(|x| *x < new);
                    v.copy_within(j..i, j + 1);
                    v[j] = new;
                }
            }
            Bin::Many(set) => {
                let found = set.remove(&old);
                debug_assert!(found, "reordering an entry the bin does not hold");
                set.insert(new);
            }
        }
    }

    /// The entries in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = T> + '_ {
        let (few, many) = match self {
            Bin::Few(v) => (Some(v.iter()), None),
            Bin::Many(set) => (None, Some(set.iter())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten()).copied()
    }

    /// The entries in order (tests).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<T> {
        self.iter().collect()
    }
}

impl Bin<Entry> {
    /// The first entry of `len` bytes or more.
    fn at_least(&self, len: u64) -> Option<Entry> {
        match self {
            Bin::Few(v) => v.get(v.partition_point(|e| e.len < len)).copied(),
            Bin::Many(set) => set.range(Entry::floor(len)..).next().copied(),
        }
    }

    /// The first entry of the greatest length: the lowest of the longest ranges.
    fn first_longest(&self) -> Option<Entry> {
        let longest = match self {
            Bin::Few(v) => v.last()?.len,
            Bin::Many(set) => set.last()?.len,
        };
        self.at_least(longest)
    }
}

/// The index by size best-fit and worst-fit need, answering as one set of `(len, end)`
/// pairs ordered "smallest first, then lowest address" would.
///
/// A two-level segregated fit: [`BINS`] bins by size class ([`bin_of`]), each an ordered
/// collection of entries ([`Bin`]), with a bitmap of the non-empty bins and a summary word
/// of the non-empty bitmap words. A lookup is a few bit operations to the first non-empty
/// bin that can hold the size (or the last non-empty one, for the largest range) and a
/// short search in that bin; an update touches one bin. Every operation stays O(log n).
#[derive(Clone, Debug)]
struct SizeIndex {
    bins: Vec<Bin>,
    /// Bit `b % 64` of word `b / 64` set iff `bins[b]` is non-empty.
    occupied: [u64; WORDS],
    /// Bit `w` set iff `occupied[w]` is non-zero.
    summary: u64,
}

impl SizeIndex {
    fn new() -> Self {
        SizeIndex { bins: vec![Bin::EMPTY; BINS], occupied: [0; WORDS], summary: 0 }
    }

    fn insert(&mut self, e: Entry) {
        let b = bin_of(e.len);
        self.bins[b].insert(e);
        self.occupied[b / 64] |= 1 << (b % 64);
        self.summary |= 1 << (b / 64);
    }

    fn remove(&mut self, e: Entry) {
        let b = bin_of(e.len);
        let bin = &mut self.bins[b];
        bin.remove(e);
        if bin.is_empty() {
            self.occupied[b / 64] &= !(1 << (b % 64));
            if self.occupied[b / 64] == 0 {
                self.summary &= !(1 << (b / 64));
            }
        }
    }

    /// The range of entry `old` is now `new` (same slot, `new.len > 0`): moved within its
    /// bin if its class is unchanged.
    fn replace(&mut self, old: Entry, new: Entry) {
        if bin_of(old.len) == bin_of(new.len) {
            self.bins[bin_of(new.len)].reorder(old, new);
        } else {
            self.remove(old);
            self.insert(new);
        }
    }

    /// The first non-empty bin from `b` on.
    fn occupied_from(&self, b: usize) -> Option<usize> {
        let w = b / 64;
        let bits = *self.occupied.get(w)? & (u64::MAX << (b % 64));
        if bits != 0 {
            return Some(w * 64 + bits.trailing_zeros() as usize);
        }
        let words = self.summary & !((2 << w) - 1);
        if words == 0 {
            return None;
        }
        let w = words.trailing_zeros() as usize;
        Some(w * 64 + self.occupied[w].trailing_zeros() as usize)
    }

    /// The smallest range of at least `n` bytes, the lowest among equals.
    fn best(&self, n: u64) -> Option<Entry> {
        let b = bin_of(n);
        let first = self.occupied_from(b)?;
        if first == b {
            // This bin may also hold shorter ranges (of `n`'s class); the bins after it
            // hold only longer ones.
            if let Some(e) = self.bins[b].at_least(n) {
                return Some(e);
            }
            return self.bins[self.occupied_from(b + 1)?].first();
        }
        self.bins[first].first()
    }

    /// The largest range, the lowest among equals.
    fn largest(&self) -> Option<Entry> {
        if self.summary == 0 {
            return None;
        }
        let w = 63 - self.summary.leading_zeros() as usize;
        let b = w * 64 + 63 - self.occupied[w].leading_zeros() as usize;
        self.bins[b].first_longest()
    }

    /// Every `(len, end)`, in `(len, end)` order (tests).
    #[cfg(test)]
    fn entries(&self) -> Vec<(u64, u64)> {
        self.bins.iter().flat_map(Bin::entries).map(|e| (e.len, e.end)).collect()
    }
}

/// A free range taken by an allocation: its start became the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) addr: u64,
    pub(crate) seg: u32,
}

impl FreeSpace {
    /// An empty set keeping the index `kind`.
    pub(crate) fn new(kind: IndexKind) -> Self {
        FreeSpace {
            by_end: BTreeMap::new(),
            arena: Vec::new(),
            vacant: Vec::new(),
            by_size: (kind == IndexKind::Size).then(SizeIndex::new),
            by_addr: (kind == IndexKind::Address).then(AddrIndex::new),
            bytes: 0,
            hint: None,
        }
    }

    /// Number of ranges.
    pub(crate) fn ranges(&self) -> usize {
        self.by_end.len()
    }

    /// Free bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The largest range's length (0 if none): O(1) with the size index, a scan of the
    /// largest ranges' class with the address index, else a scan of every range.
    pub(crate) fn largest(&self) -> u64 {
        match (&self.by_size, &self.by_addr) {
            (Some(idx), _) => idx.largest().map_or(0, |e| e.len),
            (None, Some(idx)) => idx.largest(),
            (None, None) => self.iter().map(|(start, end, _)| end - start).max().unwrap_or(0),
        }
    }

    /// Ranges in address order, as `(start, end, segment)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.by_end.iter().map(|(&end, &slot)| {
            let Span { start, seg } = self.arena[slot];
            (start, end, seg)
        })
    }

    /// Adds `start..end` of segment `seg`, merging it with adjacent ranges of that segment.
    /// If it overlaps a free range, nothing changes and the first free address inside it
    /// is returned.
    pub(crate) fn insert(&mut self, start: u64, end: u64, seg: u32) -> Result<(), u64> {
        debug_assert!(start < end);
        self.hint = None;
        // One lookup finds both neighbours: the range ending at `start` (if any), then the
        // first range ending after `start`, which overlaps if it begins before `end` and
        // is the neighbour after if it begins at `end`.
        let mut ranges = self.by_end.range(start..);
        let (before, next) = match ranges.next() {
            Some((&e, &slot)) if e == start => ((self.arena[slot].seg == seg).then_some(slot), ranges.next()),
            first => (None, first),
        };
        let after = match next {
            Some((&e, &slot)) => {
                let span = self.arena[slot];
                if span.start < end {
                    return Err(span.start.max(start));
                }
                (span.start == end && span.seg == seg).then_some((e, slot))
            }
            None => None,
        };
        self.bytes += end - start;
        match (before, after) {
            (Some(b), Some((after_end, a))) => {
                // Bridges two ranges: the one after absorbs the one before.
                let merged_start = self.arena[b].start;
                self.index_remove(start - merged_start, start, b);
                self.by_end.remove(&start);
                self.vacant.push(b);
                self.arena[a].start = merged_start;
                self.index_resize(after_end - end, after_end, a, after_end - merged_start);
            }
            (Some(b), None) => {
                // Extends the range before: its end, and so its key, moves to `end`.
                let merged_start = self.arena[b].start;
                self.by_end.remove(&start);
                self.by_end.insert(end, b);
                self.index_move(start - merged_start, start, b, end - merged_start, end);
            }
            (None, Some((after_end, a))) => {
                self.arena[a].start = start;
                self.index_resize(after_end - end, after_end, a, after_end - start);
            }
            (None, None) => {
                let slot = self.new_slot(Span { start, seg });
                self.by_end.insert(end, slot);
                self.index_insert(end - start, end, slot);
            }
        }
        Ok(())
    }

    /// Takes `start..end` out again; it lies inside one free range. Undoes an
    /// [`insert`](Self::insert) exactly, since ranges are kept maximal.
    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        self.hint = None;
        let (&e, &slot) = self.by_end.range((Excluded(start), Unbounded)).next().expect("inside a range");
        let Span { start: s, seg } = self.arena[slot];
        debug_assert!(s <= start && end <= e);
        if end < e {
            self.arena[slot].start = end;
            self.index_resize(e - s, e, slot, e - end);
        } else {
            self.index_remove(e - s, e, slot);
            self.by_end.remove(&e);
            self.vacant.push(slot);
        }
        if s < start {
            let slot = self.new_slot(Span { start: s, seg });
            self.by_end.insert(start, slot);
            self.index_insert(start - s, start, slot);
        }
        self.bytes -= end - start;
    }

    /// Next-fit: the first range from the one containing or following `cursor`, in address
    /// order, wrapping around, that holds `n` bytes; `n` is taken from its front.
    pub(crate) fn take_next_fit(&mut self, n: u64, cursor: u64) -> Option<Taken> {
        let hinted = self.hint.take().and_then(|(end, slot)| {
            // Ranges are disjoint: one starting at the cursor is the first ending after it.
            let span = &mut self.arena[slot];
            (span.start == cursor && end - span.start >= n).then(|| {
                let hit = (span.start, end, span.seg, slot);
                span.start += n;
                hit
            })
        });
        let hit = match hinted {
            Some(hit) => hit,
            None => carve_first(&mut self.arena, self.by_end.range((Excluded(cursor), Unbounded)), n)
                .or_else(|| carve_first(&mut self.arena, self.by_end.range(..=cursor), n))?,
        };
        let (start, end, _, slot) = hit;
        let taken = self.carved(hit, n);
        if start + n < end {
            self.hint = Some((end, slot));
        }
        Some(taken)
    }

    /// First-fit: the lowest range that holds `n` bytes. Needs the address index.
    pub(crate) fn take_first_fit(&mut self, n: u64) -> Option<Taken> {
        self.hint = None;
        let idx = self.by_addr.as_ref().expect("first-fit needs the address index");
        let (slot, end, len) = idx.first_fit(n)?;
        let span = &mut self.arena[slot];
        let hit = (span.start, end, span.seg, slot);
        debug_assert_eq!(end - span.start, len, "address index and ranges agree");
        span.start += n;
        Some(self.carved(hit, n))
    }

    /// Best-fit: the smallest range that holds `n` bytes, the lowest among equals.
    /// Needs the size index.
    pub(crate) fn take_best_fit(&mut self, n: u64) -> Option<Taken> {
        self.hint = None;
        let idx = self.by_size.as_ref().expect("best-fit needs the size index");
        let e = idx.best(n)?;
        Some(self.take_entry(e, n))
    }

    /// Worst-fit: the largest range, the lowest among equals, if it holds `n` bytes.
    /// Needs the size index.
    pub(crate) fn take_worst_fit(&mut self, n: u64) -> Option<Taken> {
        self.hint = None;
        let idx = self.by_size.as_ref().expect("worst-fit needs the size index");
        let e = idx.largest()?;
        if e.len < n {
            return None;
        }
        Some(self.take_entry(e, n))
    }

    /// Takes `n` bytes from the front of the range of index entry `e`, which holds them:
    /// its slot is changed in place, and the address map touched only if it is used up.
    fn take_entry(&mut self, e: Entry, n: u64) -> Taken {
        let idx = self.by_size.as_mut().expect("taken through the size index");
        let span = &mut self.arena[e.slot];
        let Span { start, seg } = *span;
        debug_assert_eq!(e.end - start, e.len, "size index and ranges agree");
        if n == e.len {
            idx.remove(e);
            self.by_end.remove(&e.end);
            self.vacant.push(e.slot);
        } else {
            span.start = start + n;
            idx.replace(e, Entry { len: e.len - n, ..e });
        }
        self.bytes -= n;
        Taken { addr: start, seg }
    }

    /// Bookkeeping after `n` bytes were taken from the front of the range `hit` (its
    /// `(start, end, segment, slot)` before the cut), whose start was already advanced in
    /// its slot.
    fn carved(&mut self, (start, end, seg, slot): (u64, u64, u32, usize), n: u64) -> Taken {
        if start + n == end {
            self.index_remove(end - start, end, slot);
            self.by_end.remove(&end);
            self.vacant.push(slot);
        } else {
            self.index_resize(end - start, end, slot, end - start - n);
        }
        self.bytes -= n;
        Taken { addr: start, seg }
    }

    /// A slot for `span`: a vacant one, or a new one.
    fn new_slot(&mut self, span: Span) -> usize {
        match self.vacant.pop() {
            Some(slot) => {
                self.arena[slot] = span;
                slot
            }
            None => {
                self.arena.push(span);
                self.arena.len() - 1
            }
        }
    }

    fn index_insert(&mut self, len: u64, end: u64, slot: usize) {
        if let Some(idx) = &mut self.by_size {
            idx.insert(Entry { len, end, slot });
        }
        if let Some(idx) = &mut self.by_addr {
            idx.insert(slot, end, len);
        }
    }

    fn index_remove(&mut self, len: u64, end: u64, slot: usize) {
        if let Some(idx) = &mut self.by_size {
            idx.remove(Entry { len, end, slot });
        }
        if let Some(idx) = &mut self.by_addr {
            idx.remove(slot, end, len);
        }
    }

    /// The range ending at `end` (slot `slot`) went from `old` to `new` bytes, its end
    /// unchanged.
    fn index_resize(&mut self, old: u64, end: u64, slot: usize, new: u64) {
        self.index_move(old, end, slot, new, end);
    }

    /// The range in slot `slot`, `old_len` bytes ending at `old_end`, grew or shrank to
    /// `new_len` bytes ending at `new_end`, with no other range between its two ends (so
    /// its place in address order is unchanged).
    fn index_move(&mut self, old_len: u64, old_end: u64, slot: usize, new_len: u64, new_end: u64) {
        if let Some(idx) = &mut self.by_size {
            idx.replace(
                Entry { len: old_len, end: old_end, slot },
                Entry { len: new_len, end: new_end, slot },
            );
        }
        if let Some(idx) = &mut self.by_addr {
            idx.replace(slot, (old_end, old_len), (new_end, new_len));
        }
    }
}

/// Advances the start of the first range of `ranges` holding `n` bytes by `n`; returns its
/// `(start, end, segment, slot)` before the cut.
fn carve_first<'a>(
    arena: &mut [Span],
    ranges: impl Iterator<Item = (&'a u64, &'a usize)>,
    n: u64,
) -> Option<(u64, u64, u32, usize)> {
    for (&end, &slot) in ranges {
        let span = &mut arena[slot];
        if end - span.start >= n {
            let hit = (span.start, end, span.seg, slot);
            span.start += n;
            return Some(hit);
        }
    }
    None
}

/// A seeded xorshift generator (seed not 0) for the heap's randomised tests: fixed
/// sequences, no dependency.
#[cfg(test)]
pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [IndexKind; 3] = [IndexKind::None, IndexKind::Size, IndexKind::Address];

    fn ranges(f: &FreeSpace) -> Vec<(u64, u64, u32)> {
        f.iter().collect()
    }

    /// Each index holds exactly the ranges, each entry naming the range's slot.
    fn check_index(f: &FreeSpace) {
        if let Some(idx) = &f.by_addr {
            let want: Vec<_> =
                f.by_end.iter().map(|(&end, &slot)| (end, end - f.arena[slot].start, slot)).collect();
            assert_eq!(idx.entries(), want);
        }
        if let Some(idx) = &f.by_size {
            let mut lens: Vec<(u64, u64)> = f.iter().map(|(s, e, _)| (e - s, e)).collect();
            lens.sort_unstable();
            assert_eq!(idx.entries(), lens);
            for e in idx.bins.iter().flat_map(Bin::entries) {
                assert_eq!(f.by_end.get(&e.end), Some(&e.slot));
            }
            // The bitmap and its summary name exactly the non-empty bins.
            for (b, bin) in idx.bins.iter().enumerate() {
                assert_eq!(idx.occupied[b / 64] >> (b % 64) & 1 == 1, !bin.is_empty(), "bin {b}");
            }
            for (w, &word) in idx.occupied.iter().enumerate() {
                assert_eq!(idx.summary >> w & 1 == 1, word != 0, "word {w}");
            }
        }
    }

    #[test]
    fn insert_coalesces_within_a_segment_only() {
        for kind in KINDS {
            let mut f = FreeSpace::new(kind);
            for (start, end, seg) in [(0, 8, 0), (16, 24, 0), (8, 16, 0)] {
                f.insert(start, end, seg).expect("disjoint"); // the last bridges both
            }
            assert_eq!(ranges(&f), [(0, 24, 0)]);
            for (start, end, seg) in [(24, 32, 1), (40, 48, 1), (32, 40, 1)] {
                f.insert(start, end, seg).expect("disjoint"); // adjacent, other segment
            }
            assert_eq!(ranges(&f), [(0, 24, 0), (24, 48, 1)]);
            assert_eq!((f.bytes(), f.largest(), f.ranges()), (48, 24, 2));
            check_index(&f);
        }
    }

    #[test]
    fn overlapping_inserts_are_refused_and_removal_undoes_insertion() {
        for kind in KINDS {
            let mut f = FreeSpace::new(kind);
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
                check_index(&f);
                f.remove(start, end);
                assert_eq!((ranges(&f), f.bytes(), f.largest()), (snapshot, bytes, largest));
                check_index(&f);
            }
        }
    }

    /// Size classes are monotone in the length, exact below [`EXACT`], and cover every
    /// length up to `u64::MAX` with [`BINS`] bins.
    #[test]
    fn size_classes_are_monotone() {
        let mut lens: Vec<u64> = (0..64).flat_map(|k| [1u64 << k, (1u64 << k) - 1, (1 << k) + 1]).collect();
        lens.extend((0..4096).step_by(7));
        lens.push(u64::MAX);
        lens.sort_unstable();
        for w in lens.windows(2) {
            assert!(bin_of(w[0]) <= bin_of(w[1]), "{w:?}");
        }
        assert!((1..EXACT).all(|len| bin_of(len) == len as usize));
        assert_eq!(bin_of(EXACT), EXACT as usize);
        assert_eq!(bin_of(u64::MAX), BINS - 1);
        // Equal width within a power of two: 1024..2048 in 16 bins of 64 bytes.
        assert_eq!(bin_of(1024 + 63), bin_of(1024));
        assert_eq!(bin_of(1024 + 64), bin_of(1024) + 1);
    }

    /// The binned index answers exactly as one ordered `(len, end)` set would, across the
    /// bins' boundaries, for every query size. (Thousands of operations: too slow for
    /// Miri, which runs the deterministic tests around it.)
    #[test]
    #[cfg_attr(miri, ignore)]
    fn size_index_matches_a_single_ordered_set() {
        let mut idx = SizeIndex::new();
        let mut reference = BTreeSet::new();
        let mut rand = xorshift(0x2545_f491_4f6c_dd1d);
        let entry = |(len, end): (u64, u64)| Entry { len, end, slot: end as usize };
        for step in 0..6000 {
            let len = match rand() % 6 {
                0 => 1 + rand() % 64,
                1 => (1 << (rand() % 20)) + rand() % 3 - 1, // both sides of powers of two
                2 => 1 + rand() % 4096,
                3 => u64::MAX - rand() % 4,                 // the highest bin
                4 => 1024 + 64 * (rand() % 4) + rand() % 2, // both sides of sub-bin bounds
                _ => 1 + rand() % 8,                        // many equal lengths: ties by lowest end
            };
            let end = rand() % 512;
            if rand().is_multiple_of(3) || reference.contains(&(len, end)) {
                if let Some(&(l, e)) = reference.iter().nth((rand() % 8) as usize) {
                    reference.remove(&(l, e));
                    idx.remove(entry((l, e)));
                }
            } else {
                reference.insert((len, end));
                idx.insert(entry((len, end)));
            }
            let largest = reference.last().and_then(|&(l, _)| reference.range((l, 0)..).next().copied());
            assert_eq!(idx.largest(), largest.map(entry), "step {step}");
            for n in [1, 7, 15, 16, 17, 63, 64, 65, 1023, 1024, 1025, 1088, rand() % 5000, u64::MAX - 2] {
                assert_eq!(
                    idx.best(n),
                    reference.range((n, 0)..).next().copied().map(entry),
                    "step {step}, n {n}"
                );
            }
        }
        assert_eq!(idx.entries(), reference.into_iter().collect::<Vec<_>>());
    }

    /// A bin that outgrows its vector becomes a set and keeps the same order and answers;
    /// emptied to half the vector's bound, it is a vector again.
    #[test]
    fn a_bin_grows_from_a_vector_to_a_set_and_back() {
        let mut bin = Bin::Few(Vec::new());
        let entries: Vec<Entry> = (0..3 * BIN_VEC as u64)
            .map(|i| {
                let end = (i * 7919) % 1000 * 8;
                Entry { len: 8 + end % 3, end, slot: i as usize }
            })
            .collect();
        for (k, &e) in entries.iter().enumerate() {
            bin.insert(e);
            bin.insert(e); // a duplicate changes nothing
            assert_eq!(matches!(bin, Bin::Many(_)), k >= BIN_VEC, "after {} entries", k + 1);
        }
        let mut sorted = entries.clone();
        sorted.sort_unstable();
        assert_eq!(bin.entries(), sorted);
        assert_eq!(bin.at_least(9), sorted.iter().find(|e| e.len >= 9).copied());
        assert_eq!(bin.first_longest(), sorted.iter().find(|e| e.len == 10).copied());
        for (k, &e) in sorted.iter().enumerate() {
            assert_eq!(bin.first(), Some(e));
            bin.remove(e);
            let left = sorted.len() - k - 1;
            assert_eq!(matches!(bin, Bin::Few(_)), left <= BIN_VEC / 2, "with {left} left");
        }
        assert!(bin.is_empty() && bin.first().is_none());
    }

    /// Moving an entry whose length changed, within a vector bin and within a set bin, to
    /// either side and to both ends, keeps the bin in order with every other entry in it.
    #[test]
    fn reordering_an_entry_keeps_its_bin_sorted() {
        for count in [1u64, 2, 5, BIN_VEC as u64 + 3] {
            let entries: Vec<Entry> =
                (0..count).map(|i| Entry { len: 100 + 10 * i, end: 8 * i, slot: i as usize }).collect();
            for (k, &old) in entries.iter().enumerate() {
                for len in [1, 99, 105, 100 + 10 * count, u64::MAX] {
                    let mut bin = Bin::Few(Vec::new());
                    entries.iter().for_each(|&e| bin.insert(e));
                    assert_eq!(matches!(bin, Bin::Many(_)), count > BIN_VEC as u64);
                    let new = Entry { len, ..old };
                    bin.reorder(old, new);
                    let mut want = entries.clone();
                    want[k] = new;
                    want.sort_unstable();
                    assert_eq!(bin.entries(), want, "{count} entries, entry {k} to {len}");
                }
            }
        }
    }

    /// A peer's frees can leave a great many ranges of one length: their bin is a B-tree
    /// set (each operation O(log n), no vector of them to shift), best-fit still takes the
    /// lowest first and worst-fit the lowest of the largest, and the arena reuses the slots
    /// of ranges merged away instead of growing.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn many_ranges_of_one_size_stay_logarithmic() {
        const N: u64 = 20_000;
        let mut f = FreeSpace::new(IndexKind::Size);
        for i in (0..N).rev() {
            f.insert(32 * i, 32 * i + 16, 0).expect("disjoint");
        }
        let idx = f.by_size.as_ref().expect("indexed");
        assert!(matches!(idx.bins[bin_of(16)], Bin::Many(ref s) if s.len() == N as usize));
        assert_eq!(f.take_best_fit(16), Some(Taken { addr: 0, seg: 0 }));
        assert_eq!(f.take_best_fit(8), Some(Taken { addr: 32, seg: 0 }));
        assert_eq!(f.take_worst_fit(16), Some(Taken { addr: 64, seg: 0 }));
        assert_eq!(f.take_best_fit(8), Some(Taken { addr: 40, seg: 0 })); // the 8 left at 40
        // Fill every gap: the ranges merge into one, slot by slot.
        f.insert(0, 16, 0).expect("disjoint");
        f.insert(32, 48, 0).expect("disjoint");
        f.insert(64, 80, 0).expect("disjoint");
        for i in 0..N - 1 {
            f.insert(32 * i + 16, 32 * i + 32, 0).expect("disjoint");
        }
        assert_eq!(ranges(&f), [(0, 32 * (N - 1) + 16, 0)]);
        check_index(&f);
        assert_eq!(f.arena.len(), N as usize);
        // Split and merge again: slots are reused, the arena does not grow.
        for i in 0..N - 1 {
            f.remove(32 * i + 16, 32 * i + 32);
        }
        assert_eq!((f.ranges(), f.arena.len()), (N as usize, N as usize));
        check_index(&f);
    }

    /// Best-fit and worst-fit takes against a plain list of ranges, over thousands of random
    /// takes and frees: the same ranges are chosen, and the index stays exact after every
    /// step, whether the rest of a range stays in its bin or moves to another, in vector
    /// bins and in set bins.
    #[test]
    #[cfg_attr(miri, ignore = "20,000 steps; the unit tests above cover each path under Miri")]
    fn takes_choose_as_a_plain_list_would_and_keep_the_index_exact() {
        let mut rand = xorshift(0x5eed_0000_5eed);
        let mut f = FreeSpace::new(IndexKind::Size);
        f.insert(0, 1 << 20, 0).expect("disjoint");
        // 100 blocks of 8 bytes side by side, every other one freed: 50 ranges of one
        // length, a set bin from the start.
        let mut used: Vec<(u64, u64)> = Vec::new();
        for i in 0..100 {
            let t = f.take_best_fit(8).expect("room");
            if i % 2 == 1 {
                used.push((t.addr, t.addr + 8));
            }
        }
        let mut with_a_set_bin = 0usize;
        for step in 0..20_000 {
            if used.len() > 300 || (!used.is_empty() && rand().is_multiple_of(3)) {
                let (a, b) = used.swap_remove((rand() % used.len() as u64) as usize);
                f.insert(a, b, 0).expect("a used block is not free");
            } else {
                // Mostly small (many ranges of a few lengths: set bins), some up to 8 KiB.
                let n = 8 * if rand().is_multiple_of(4) { 1 + rand() % 1024 } else { 1 + rand() % 8 };
                let list: Vec<(u64, u64, u32)> = f.iter().collect();
                let fits = list.iter().filter(|(a, b, _)| b - a >= n);
                let (worst, want) = if rand().is_multiple_of(2) {
                    (false, fits.min_by_key(|(a, b, _)| (b - a, *a)).map(|r| r.0))
                } else {
                    let largest = list.iter().max_by_key(|(a, b, _)| (b - a, u64::MAX - a));
                    (true, largest.filter(|(a, b, _)| b - a >= n).map(|r| r.0))
                };
                let got = if worst { f.take_worst_fit(n) } else { f.take_best_fit(n) };
                assert_eq!(got.map(|t| t.addr), want, "step {step}, n {n}, worst {worst}");
                if let Some(t) = got {
                    used.push((t.addr, t.addr + n));
                }
            }
            check_index(&f);
            let idx = f.by_size.as_ref().expect("indexed");
            with_a_set_bin += usize::from(idx.bins.iter().any(|b| matches!(b, Bin::Many(_))));
        }
        assert!(with_a_set_bin > 1000, "set bins were exercised in {with_a_set_bin} steps");
    }

    /// First-fit takes against a plain list of ranges, over thousands of random takes and
    /// frees (which merge, split and use up ranges): the lowest range that fits is chosen,
    /// and the address index stays exact after every step.
    #[test]
    #[cfg_attr(miri, ignore = "10,000 steps; the unit tests cover each path under Miri")]
    fn first_fit_takes_the_lowest_fitting_range_and_keeps_the_index_exact() {
        let mut rand = xorshift(0xf1f1_0000_5eed);
        let mut f = FreeSpace::new(IndexKind::Address);
        f.insert(0, 1 << 20, 0).expect("disjoint");
        f.insert(1 << 20, 2 << 20, 1).expect("disjoint"); // adjacent, never merged
        let mut used: Vec<(u64, u64)> = Vec::new();
        for step in 0..10_000 {
            if used.len() > 300 || (!used.is_empty() && rand().is_multiple_of(3)) {
                let (a, b) = used.swap_remove((rand() % used.len() as u64) as usize);
                let seg = u32::from(a >= 1 << 20);
                f.insert(a, b, seg).expect("a used block is not free");
            } else {
                let n = 8 * if rand().is_multiple_of(4) { 1 + rand() % 1024 } else { 1 + rand() % 8 };
                let want = f.iter().find(|(a, b, _)| b - a >= n).map(|r| r.0);
                let got = f.take_first_fit(n);
                assert_eq!(got.map(|t| t.addr), want, "step {step}, n {n}");
                if let Some(t) = got {
                    used.push((t.addr, t.addr + n));
                }
            }
            check_index(&f);
            let largest = f.iter().map(|(a, b, _)| b - a).max().unwrap_or(0);
            assert_eq!(f.largest(), largest, "step {step}");
        }
        assert!(f.ranges() > 50, "the test fragmented the space: {} ranges", f.ranges());
    }

    /// Next-fit takes against a plain list of ranges, over thousands of random takes and
    /// frees: the first range from the cursor on (wrapping around) that fits is chosen,
    /// whether it is the range the last take left behind (found through the hint), a range
    /// a free has just changed, or one found after the cursor moved elsewhere.
    #[test]
    #[cfg_attr(miri, ignore = "10,000 steps; the unit tests cover each path under Miri")]
    fn next_fit_takes_the_first_fitting_range_from_the_cursor() {
        let mut rand = xorshift(0x0e47_0000_5eed);
        let mut f = FreeSpace::new(IndexKind::None);
        f.insert(0, 1 << 16, 0).expect("disjoint");
        let mut used: Vec<(u64, u64)> = Vec::new();
        let mut cursor = 0u64;
        let mut hinted = 0usize;
        for step in 0..10_000 {
            if used.len() > 200 || (!used.is_empty() && rand().is_multiple_of(4)) {
                let (a, b) = used.swap_remove((rand() % used.len() as u64) as usize);
                f.insert(a, b, 0).expect("a used block is not free");
            } else {
                if rand().is_multiple_of(16) {
                    // The allocator's cursor is only ever a block's end, but any address
                    // must give the same choice as the list's.
                    cursor = rand() % (1 << 16);
                }
                let n = 8 * if rand().is_multiple_of(8) { 1 + rand() % 256 } else { 1 + rand() % 4 };
                let list: Vec<(u64, u64, u32)> = f.iter().collect();
                let want = list
                    .iter()
                    .filter(|(_, b, _)| *b > cursor)
                    .chain(list.iter().filter(|(_, b, _)| *b <= cursor))
                    .find(|(a, b, _)| b - a >= n)
                    .map(|r| r.0);
                hinted += usize::from(f.hint.is_some_and(|(_, slot)| f.arena[slot].start == cursor));
                let got = f.take_next_fit(n, cursor);
                assert_eq!(got.map(|t| t.addr), want, "step {step}, n {n}, cursor {cursor}");
                if let Some(t) = got {
                    used.push((t.addr, t.addr + n));
                    cursor = t.addr + n;
                }
            }
            assert_eq!(f.bytes(), f.iter().map(|(a, b, _)| b - a).sum::<u64>(), "step {step}");
        }
        assert!(hinted > 1000, "takes through the hint: {hinted}");
        assert!(f.ranges() > 20, "the test fragmented the space: {} ranges", f.ranges());
    }

    #[test]
    fn carving_keeps_the_index_in_step() {
        let mut f = FreeSpace::new(IndexKind::Size);
        f.insert(0, 64, 0).expect("disjoint");
        f.insert(100, 132, 0).expect("disjoint");
        assert_eq!(f.take_best_fit(32), Some(Taken { addr: 100, seg: 0 }));
        assert_eq!(ranges(&f), [(0, 64, 0)]);
        assert_eq!(f.take_worst_fit(16), Some(Taken { addr: 0, seg: 0 }));
        assert_eq!(f.take_worst_fit(64), None);
        assert_eq!(f.by_size.as_ref().map(SizeIndex::entries), Some(vec![(48, 64)]));
        check_index(&f);
        assert_eq!(f.take_next_fit(48, 0), Some(Taken { addr: 16, seg: 0 }));
        assert!(f.ranges() == 0 && f.by_size.as_ref().is_some_and(|i| i.entries().is_empty()));
        assert!(f.by_size.as_ref().is_some_and(|i| i.occupied == [0; WORDS] && i.summary == 0));
        assert_eq!(f.bytes(), 0);
    }
}
