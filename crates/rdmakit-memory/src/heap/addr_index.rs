//! The index first-fit needs: "the lowest free range of at least `n` bytes" without
//! walking the ranges below it.

use super::free_space::{BINS, Bin, bin_of};

/// A free range of `len` bytes ending at `end`, in arena slot `slot`. Ordered by address
/// (ends of disjoint ranges are distinct, and in the order of their starts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct AddrEntry {
    end: u64,
    len: u64,
    slot: usize,
}

/// Classes per group of the two-level table of lowest addresses.
const GROUP: usize = 32;
/// Groups: enough for every class of [`bin_of`].
const GROUPS: usize = BINS.div_ceil(GROUP);
/// A table value for "no range".
const NONE: u64 = u64::MAX;

/// The free ranges by size class (the size index's classes, [`bin_of`]), each class in
/// address order, under a two-level table of the lowest address per class and per group
/// of [`GROUP`] classes.
///
/// Every class above `n`'s holds only ranges of more than `n` bytes, so the lowest of them
/// that fits is the lowest address in all those classes: the rest of `n`'s group and the
/// groups above. Bit masks of the non-empty classes of each group, and of the non-empty
/// groups, let a lookup visit only those (a few, where ranges are few; at most one word per
/// class of the group and per group). In `n`'s own class, shorter ranges sit beside
/// longer ones: it is scanned in address order, up to the address the classes above offer
/// (O(log n) everywhere else, but that scan is as long as the class has shorter ranges
/// below the answer). An update touches one class, and the table only when it changes the
/// class's lowest address.
///
/// Table values are a range's last address (`end - 1`), so that [`NONE`] cannot be one.
#[derive(Clone, Debug)]
pub(super) struct AddrIndex {
    bins: Vec<Bin<AddrEntry>>,
    /// Class `b`'s lowest last address.
    lowest: Box<[u64; GROUPS * GROUP]>,
    /// The lowest of each group's `lowest`.
    group_lowest: [u64; GROUPS],
    /// Bit `c` of word `g` set iff class `g * GROUP + c` is non-empty.
    classes: [u32; GROUPS],
    /// Bit `g` set iff group `g` is non-empty.
    groups: u32,
}

// The masks' widths.
const _: () = assert!(GROUP == 32 && GROUPS <= 32);

/// The set bits of `bits`, lowest first.
fn bits_of(mut bits: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let b = bits.trailing_zeros() as usize;
        bits &= bits.wrapping_sub(1);
        (b < 32).then_some(b)
    })
}

impl AddrIndex {
    pub(super) fn new() -> Self {
        AddrIndex {
            bins: vec![Bin::EMPTY; BINS],
            lowest: Box::new([NONE; GROUPS * GROUP]),
            group_lowest: [NONE; GROUPS],
            classes: [0; GROUPS],
            groups: 0,
        }
    }

    /// Sets class `b`'s lowest last address (or [`NONE`]) and its bit.
    fn set_lowest(&mut self, b: usize, v: u64) {
        self.lowest[b] = v;
        let bit = 1 << (b % GROUP);
        if v == NONE {
            self.classes[b / GROUP] &= !bit;
        } else {
            self.classes[b / GROUP] |= bit;
        }
    }

    /// Sets group `g`'s lowest last address (or [`NONE`]) and its bit.
    fn set_group(&mut self, g: usize, v: u64) {
        self.group_lowest[g] = v;
        if v == NONE {
            self.groups &= !(1 << g);
        } else {
            self.groups |= 1 << g;
        }
    }

    /// The lowest of group `g`'s classes from `from` (a class of the group) on, and the
    /// class holding it (`(NONE, 0)` if none).
    fn group_min_from(&self, g: usize, from: usize) -> (u64, usize) {
        let mask = self.classes[g] & (u32::MAX << (from % GROUP));
        bits_of(mask).map(|c| (self.lowest[g * GROUP + c], g * GROUP + c)).min().unwrap_or((NONE, 0))
    }

    /// The lowest range of at least `n` bytes (`n > 0`), as `(slot, end, len)`.
    pub(super) fn first_fit(&self, n: u64) -> Option<(usize, u64, u64)> {
        let b = bin_of(n);
        let (above, class) = self.lowest_from(b + 1);
        // `n`'s own class, in address order, below what the classes above offer.
        let own = if self.lowest[b] < above {
            match &self.bins[b] {
                Bin::Few(v) => v.iter().take_while(|e| e.end - 1 < above).find(|e| e.len >= n).copied(),
                Bin::Many(set) => set.iter().take_while(|e| e.end - 1 < above).find(|e| e.len >= n).copied(),
            }
        } else {
            None
        };
        let e = match own {
            Some(e) => e,
            None if above == NONE => return None,
            None => self.bins[class].first().expect("the table names a non-empty class"),
        };
        Some((e.slot, e.end, e.len))
    }

    /// The longest range's length (0 if none): the longest in the highest non-empty class,
    /// which is scanned (this serves statistics and error reports, not allocation).
    pub(super) fn largest(&self) -> u64 {
        // The highest non-empty group, then its highest non-empty class: two short scans.
        let Some(g) = self.groups.checked_ilog2() else { return 0 };
        let g = g as usize;
        let at = self.classes[g].checked_ilog2().expect("a non-empty group has a non-empty class");
        let b = g * GROUP + at as usize;
        self.bins[b].iter().map(|e| e.len).max().expect("a non-empty class")
    }

    /// Adds the range `len` bytes long ending at `end`, in arena slot `slot`.
    pub(super) fn insert(&mut self, slot: usize, end: u64, len: u64) {
        let b = bin_of(len);
        self.bins[b].insert(AddrEntry { end, len, slot });
        if end - 1 < self.lowest[b] {
            self.set_lowest(b, end - 1);
            let g = b / GROUP;
            if end - 1 < self.group_lowest[g] {
                self.set_group(g, end - 1);
            }
        }
    }

    /// Removes the range of `len` bytes ending at `end` (slot `slot`), which is indexed.
    pub(super) fn remove(&mut self, slot: usize, end: u64, len: u64) {
        let b = bin_of(len);
        self.bins[b].remove(AddrEntry { end, len, slot });
        if end - 1 == self.lowest[b] {
            self.set_lowest(b, self.bins[b].first().map_or(NONE, |e| e.end - 1));
            let g = b / GROUP;
            if end - 1 == self.group_lowest[g] {
                self.set_group(g, self.group_min_from(g, 0).0);
            }
        }
    }

    /// The range in slot `slot` went from `(end, len)` `old` to `new`, with no other range
    /// between its two ends, so that its place in address order is unchanged: in place if
    /// its class is unchanged.
    pub(super) fn replace(&mut self, slot: usize, old: (u64, u64), new: (u64, u64)) {
        let ((old_end, old_len), (new_end, new_len)) = (old, new);
        let b = bin_of(old_len);
        if b != bin_of(new_len) {
            self.remove(slot, old_end, old_len);
            self.insert(slot, new_end, new_len);
            return;
        }
        let (old_entry, new_entry) =
            (AddrEntry { end: old_end, len: old_len, slot }, AddrEntry { end: new_end, len: new_len, slot });
        self.bins[b].replace(old_entry, new_entry);
        if old_end != new_end && self.lowest[b] == old_end - 1 {
            // Still its class's lowest (its place is unchanged), at another address.
            self.set_lowest(b, new_end - 1);
            let g = b / GROUP;
            if new_end < old_end {
                self.set_group(g, self.group_lowest[g].min(new_end - 1));
            } else if self.group_lowest[g] == old_end - 1 {
                self.set_group(g, self.group_min_from(g, 0).0);
            }
        }
    }

    /// The lowest last address in classes `from..` and the class holding it ([`NONE`] and
    /// an unspecified class if they hold nothing).
    fn lowest_from(&self, from: usize) -> (u64, usize) {
        let g = from / GROUP;
        if g >= GROUPS {
            return (NONE, 0);
        }
        // The rest of `from`'s group, then the groups above: only the non-empty ones (no
        // two classes hold the same address).
        let here = self.group_min_from(g, from);
        let above = bits_of(self.groups & !(u32::MAX >> (31 - g)))
            .map(|h| (self.group_lowest[h], h))
            .min()
            .unwrap_or((NONE, 0));
        if here.0 <= above.0 {
            return here;
        }
        let (v, h) = above;
        let at = bits_of(self.classes[h]).find(|&c| self.lowest[h * GROUP + c] == v);
        (v, h * GROUP + at.expect("a group's lowest is one of its classes'"))
    }

    /// Every `(end, len, slot)` in address order, after checking each entry's class and the
    /// whole table (tests).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<(u64, u64, usize)> {
        let mut out = Vec::new();
        for (b, bin) in self.bins.iter().enumerate() {
            assert_eq!(self.lowest[b], bin.first().map_or(NONE, |e| e.end - 1), "class {b}");
            out.extend(bin.iter().inspect(|e| assert_eq!(bin_of(e.len), b)).map(|e| (e.end, e.len, e.slot)));
        }
        assert!(self.lowest[BINS..].iter().all(|&v| v == NONE));
        for b in 0..GROUPS * GROUP {
            assert_eq!(
                self.classes[b / GROUP] >> (b % GROUP) & 1 == 1,
                self.lowest[b] != NONE,
                "class {b}'s bit"
            );
        }
        for (g, &v) in self.group_lowest.iter().enumerate() {
            assert_eq!(self.groups >> g & 1 == 1, v != NONE, "group {g}'s bit");
            assert_eq!(
                v,
                self.lowest[g * GROUP..][..GROUP].iter().copied().min().unwrap_or(NONE),
                "group {g}"
            );
        }
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::free_space::xorshift;
    use super::*;
    use std::collections::BTreeMap;

    /// Against a plain map from end to `(len, slot)`, through thousands of random inserts,
    /// removals, resizes and moves of a range's end past no other range (within a class and
    /// across classes): the same ranges, the table exact, and `first_fit` the first entry in
    /// address order that fits, for every query, including sizes in a class that also holds
    /// shorter ranges. (Too slow for Miri.)
    #[test]
    #[cfg_attr(miri, ignore)]
    fn first_fit_matches_a_scan_in_address_order() {
        let mut idx = AddrIndex::new();
        let mut reference: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
        let mut free_slots: Vec<usize> = (0..256).rev().collect();
        let mut rand = xorshift(0x2545_f491_4f6c_dd1d);
        let len = |rand: &mut dyn FnMut() -> u64| match rand() % 4 {
            0 => 1 + rand() % (1 << 20),
            1 => 1024 + rand() % 64, // one class: shorter and longer ranges side by side
            _ => 1 + rand() % 64,
        };
        for step in 0..20_000 {
            let end = 1 + rand() % 4096;
            match (reference.get(&end).copied(), rand() % 3) {
                (None, _) => {
                    let Some(slot) = free_slots.pop() else { continue };
                    let len = len(&mut rand);
                    idx.insert(slot, end, len);
                    reference.insert(end, (len, slot));
                }
                (Some((old, slot)), 0) => {
                    idx.remove(slot, end, old);
                    reference.remove(&end);
                    free_slots.push(slot);
                }
                (Some((old, slot)), 1) => {
                    let new = len(&mut rand);
                    idx.replace(slot, (end, old), (end, new));
                    reference.insert(end, (new, slot));
                }
                (Some((old, slot)), _) => {
                    // Its end moves (as when a free extends the range before it), up or
                    // down but past no other range, and its length changes.
                    let new_end = (end + rand() % 64).saturating_sub(32).max(1);
                    let (lo, hi) = (end.min(new_end), end.max(new_end));
                    if reference.range(lo..=hi).count() > 1 {
                        continue;
                    }
                    let new = len(&mut rand);
                    idx.replace(slot, (end, old), (new_end, new));
                    reference.remove(&end);
                    reference.insert(new_end, (new, slot));
                }
            }
            if step % 97 == 0 {
                let want: Vec<_> = reference.iter().map(|(&e, &(l, s))| (e, l, s)).collect();
                assert_eq!(idx.entries(), want, "step {step}");
            }
            let n = len(&mut rand);
            let want = reference.iter().find(|(_, (l, _))| *l >= n).map(|(&e, &(l, s))| (s, e, l));
            assert_eq!(idx.first_fit(n), want, "step {step}, n {n}");
            let largest = reference.values().map(|&(l, _)| l).max().unwrap_or(0);
            assert_eq!(idx.largest(), largest, "step {step}");
        }
    }

    /// Moves of a range's end past no other range (what a free extending the range before
    /// it does) keep the tables exact, through every branch of `replace`: across classes,
    /// within a class, as its class's lowest, and as its group's lowest moving up (which
    /// recomputes the group). Few ranges over a wide space, so that most moves pass no
    /// other; each kind of move is counted. (Too slow for Miri.)
    #[test]
    #[cfg_attr(miri, ignore)]
    fn moves_of_a_ranges_end_keep_the_tables_exact() {
        let mut idx = AddrIndex::new();
        let mut reference: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
        let mut rand = xorshift(0x9e37_79b9_7f4a_7c15);
        for slot in 0..32 {
            let (end, len) = (1 + rand() % (1 << 16), 1 + rand() % 120);
            if reference.insert(end, (len, slot)).is_none() {
                idx.insert(slot, end, len);
            }
        }
        // [across classes, within a class, as its class's lowest, as its group's lowest
        // moving up]
        let mut seen = [0usize; 4];
        for step in 0..20_000 {
            let k = (rand() % reference.len() as u64) as usize;
            let (&end, &(len, slot)) = reference.iter().nth(k).expect("k < len");
            let d = 1 + rand() % 8;
            let new_end = if rand().is_multiple_of(2) { end + d } else { end.saturating_sub(d).max(1) };
            let (lo, hi) = (end.min(new_end), end.max(new_end));
            if new_end == end || reference.range(lo..=hi).count() > 1 {
                continue;
            }
            let new_len =
                if rand().is_multiple_of(4) { 1 + rand() % 120 } else { len.max(2) - 1 + rand() % 3 };
            let b = bin_of(len);
            let lowest = |same: &dyn Fn(u64) -> bool| {
                reference.iter().filter(|(_, (l, _))| same(*l)).map(|(&e, _)| e).min()
            };
            if bin_of(new_len) != b {
                seen[0] += 1;
            } else {
                seen[1] += 1;
                if lowest(&|l| bin_of(l) == b) == Some(end) {
                    seen[2] += 1;
                }
                if lowest(&|l| bin_of(l) / GROUP == b / GROUP) == Some(end) && new_end > end {
                    seen[3] += 1;
                }
            }
            idx.replace(slot, (end, len), (new_end, new_len));
            reference.remove(&end);
            reference.insert(new_end, (new_len, slot));
            let want: Vec<_> = reference.iter().map(|(&e, &(l, s))| (e, l, s)).collect();
            assert_eq!(idx.entries(), want, "step {step}");
            let n = 1 + rand() % 128;
            let first = reference.iter().find(|(_, (l, _))| *l >= n).map(|(&e, &(l, s))| (s, e, l));
            assert_eq!(idx.first_fit(n), first, "step {step}, n {n}");
        }
        assert!(seen.iter().all(|&c| c > 100), "each kind of move, counted: {seen:?}");
    }

    /// The edges: a range ending at the top of the address space, sizes in the highest
    /// classes (the last group, which is partial), and an empty index.
    #[test]
    fn extreme_addresses_and_sizes() {
        let mut idx = AddrIndex::new();
        assert_eq!((idx.first_fit(1), idx.largest()), (None, 0));
        idx.insert(0, u64::MAX, 16);
        idx.insert(1, 1 << 63, u64::MAX >> 1);
        assert_eq!(idx.first_fit(16), Some((1, 1 << 63, u64::MAX >> 1)));
        assert_eq!(idx.first_fit(u64::MAX >> 1), Some((1, 1 << 63, u64::MAX >> 1)));
        assert_eq!(idx.first_fit(u64::MAX), None);
        idx.remove(1, 1 << 63, u64::MAX >> 1);
        assert_eq!(idx.first_fit(8), Some((0, u64::MAX, 16)));
        assert_eq!(idx.largest(), 16);
        idx.replace(0, (u64::MAX, 16), (u64::MAX, 8));
        assert_eq!((idx.first_fit(9), idx.first_fit(8)), (None, Some((0, u64::MAX, 8))));
        assert_eq!(idx.entries(), [(u64::MAX, 8, 0)]);

        // The last, partial group of classes: all of the address space (class 975, the
        // highest) and half of it (class 960, the group's first).
        let mut idx = AddrIndex::new();
        idx.insert(0, u64::MAX, u64::MAX);
        assert_eq!((bin_of(u64::MAX), bin_of(1 << 63)), (BINS - 1, BINS - 16));
        assert_eq!((idx.first_fit(u64::MAX), idx.largest()), (Some((0, u64::MAX, u64::MAX)), u64::MAX));
        idx.replace(0, (u64::MAX, u64::MAX), (u64::MAX, 1 << 63));
        assert_eq!((idx.first_fit(u64::MAX), idx.first_fit(1 << 63)), (None, Some((0, u64::MAX, 1 << 63))));
        assert_eq!(idx.largest(), 1 << 63);
        idx.insert(1, 1 << 62, 8);
        assert_eq!(
            (idx.first_fit(8), idx.first_fit(9)),
            (Some((1, 1 << 62, 8)), Some((0, u64::MAX, 1 << 63)))
        );
        assert_eq!(idx.entries(), [(1 << 62, 8, 1), (u64::MAX, 1 << 63, 0)]);
        idx.remove(0, u64::MAX, 1 << 63);
        idx.remove(1, 1 << 62, 8);
        assert_eq!((idx.first_fit(1), idx.largest(), idx.entries()), (None, 0, vec![]));
    }
}
