//! What a device reduces a row of logits to for the sampler: the tokens it can pick from.
//! A sampler without penalties draws from the tokens near the top alone — the maximum's ties
//! (greedy), or those its temperature's prune margin and its top-k keep — so a backend that
//! computes logits on a device can cut each row down where it is and read back a few pairs
//! instead of the vocabulary. `Cut::apply` is the rule; a device must give the same set.

/// The most candidates one row may give back; when a row has more, the step's logits are read
/// back whole instead.
pub const MAX_CANDIDATES: usize = 2048;

/// How one row is cut: with `m` the largest non-NaN value, a value `v` is kept when
/// `v * scale >= m * scale - margin` (each product rounded to f32, NaN never kept), and,
/// with `top_k > 0`, when its scaled value is among the `top_k` largest of those kept in
/// `f32::total_cmp` order, all ties with the `top_k`-th kept. `scale` is finite and > 0 (an
/// inverse temperature), `margin` finite and >= 0; the engine rejects other cuts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    pub scale: f32,
    pub margin: f32,
    pub top_k: u32,
}

impl Cut {
    /// The maximum and its ties: all a greedy pick needs.
    pub const GREEDY: Cut = Cut { scale: 1.0, margin: 0.0, top_k: 0 };

    /// Row `row`'s candidates as `(id, value)`, in id order, appended to `out`.
    pub fn apply(&self, row: &[f32], out: &mut Vec<(u32, f32)>) {
        let m = row.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        let floor = m * self.scale - self.margin;
        let start = out.len();
        out.extend(
            row.iter()
                .enumerate()
                .filter(|&(_, &v)| v * self.scale >= floor)
                .map(|(i, &v)| (i as u32, v)),
        );
        let k = self.top_k as usize;
        if k == 0 || out.len() - start <= k {
            return;
        }
        let mut z: Vec<f32> = out[start..].iter().map(|&(_, v)| v * self.scale).collect();
        z.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = z[k - 1];
        let mut w = start;
        for r in start..out.len() {
            if (out[r].1 * self.scale).total_cmp(&kth).is_ge() {
                out[w] = out[r];
                w += 1;
            }
        }
        out.truncate(w);
    }
}

/// Rows cut to their candidates: row `r`'s are `items[offsets[r]..offsets[r + 1]]`, in an
/// order that may differ between backends (a sampler orders them itself).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidates {
    pub offsets: Vec<usize>,
    pub items: Vec<(u32, f32)>,
}

impl Candidates {
    pub fn clear(&mut self) {
        self.offsets.clear();
        self.offsets.push(0);
        self.items.clear();
    }

    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn row(&self, r: usize) -> &[(u32, f32)] {
        &self.items[self.offsets[r]..self.offsets[r + 1]]
    }
}

/// The greedy pick: the id of the largest value, the lowest id among equals; NaN never wins,
/// and a row with nothing above -inf picks 0.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// `argmax` of a row from its `Cut::GREEDY` candidates, in any order: the same pick.
pub fn argmax_of(candidates: &[(u32, f32)]) -> u32 {
    let mut best: Option<(u32, f32)> = None;
    for &(i, v) in candidates {
        let better = match best {
            None => v > f32::NEG_INFINITY,
            Some((bi, bv)) => v > bv || (v == bv && i < bi),
        };
        if better {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(row: &[f32], c: Cut) -> Vec<(u32, f32)> {
        let mut out = vec![(99, 9.0)];
        c.apply(row, &mut out);
        assert_eq!(out[0], (99, 9.0), "what was in `out` before is kept");
        out.split_off(1)
    }

    #[test]
    fn greedy_keeps_the_maximum_and_its_ties() {
        let row = [1.0, 3.0, f32::NAN, 3.0, -2.0];
        assert_eq!(cut(&row, Cut::GREEDY), vec![(1, 3.0), (3, 3.0)]);
        assert_eq!(argmax_of(&[(3, 3.0), (1, 3.0)]), argmax(&row));
        assert!(cut(&[f32::NAN; 3], Cut::GREEDY).is_empty());
        assert_eq!(argmax_of(&[]), argmax(&[f32::NAN; 3]));
        // Nothing above -inf: every -inf is a candidate, and the pick is 0 either way.
        let low = [f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY];
        assert_eq!(cut(&low, Cut::GREEDY).len(), 2);
        assert_eq!(argmax_of(&cut(&low, Cut::GREEDY)), argmax(&low));
    }

    #[test]
    fn the_margin_is_on_scaled_values_and_top_k_keeps_the_kth_ties() {
        let row = [0.0, 10.0, 9.0, 4.0, 9.0, -50.0, 8.0];
        let c = Cut { scale: 2.0, margin: 12.0, top_k: 0 };
        // m·s − margin = 8: kept where 2v >= 8.
        assert_eq!(cut(&row, c).iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3, 4, 6]);
        let k2 = Cut { top_k: 2, ..c };
        assert_eq!(cut(&row, k2).iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 4]);
        let k9 = Cut { top_k: 9, ..c };
        assert_eq!(cut(&row, k9), cut(&row, c));
        // total_cmp: -0 ranks below +0, as the sampler orders them.
        let zeros = [-0.0, 0.0, -1.0];
        let k1 = Cut { scale: 1.0, margin: 5.0, top_k: 1 };
        assert_eq!(cut(&zeros, k1), vec![(1, 0.0)]);
    }
}
