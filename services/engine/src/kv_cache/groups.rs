//! How a model's layers share the KV pool's blocks: one group of every layer, or, for a model
//! with sliding-window layers, groups of one kind each, so a window's blocks can leave.

/// How a model's layers share the pool's blocks. Every layer of a block goes together unless
/// some layers attend through a sliding window: then the pool's block holds `unit` layers of
/// one kind (`gcd(#global, #local)`), a sequence has one table per group of `unit` layers,
/// and a local group's blocks can leave once the window has moved past them, so a local
/// layer's KV is O(window) per sequence while a global one keeps its whole history.
///
/// A *logical* block (what leaves the engine, and what the layout describes) is still every
/// layer of `block_size` tokens in layer order: the groups are this engine's own business.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// `(group, index in the group's block)` of each model layer.
    place: Vec<(usize, usize)>,
    /// The layers of each group, in their order within its block (`unit` each).
    pub(super) members: Vec<Vec<usize>>,
    /// Each group's window in tokens, `None` for one that keeps every block.
    pub(super) windows: Vec<Option<usize>>,
}

impl KvGroups {
    /// One group of every layer: a pool block is a logical block.
    pub fn whole(layers: usize) -> Self {
        Self {
            place: (0..layers).map(|l| (0, l)).collect(),
            members: vec![(0..layers).collect()],
            windows: vec![None],
        }
    }

    /// Groups for a model whose layers `local[l]` attend through a window of `window` tokens.
    pub fn windowed(local: &[bool], window: usize) -> Self {
        let n_local = local.iter().filter(|&&l| l).count();
        if n_local == 0 || window == 0 {
            return Self::whole(local.len());
        }
        let unit = gcd(local.len() - n_local, n_local);
        let (mut place, mut members, mut windows) =
            (Vec::new(), Vec::<Vec<usize>>::new(), Vec::new());
        // The group each kind is filling (global, local).
        let mut open: [Option<usize>; 2] = [None, None];
        for (l, &is_local) in local.iter().enumerate() {
            let kind = usize::from(is_local);
            let g = match open[kind] {
                Some(g) if members[g].len() < unit => g,
                _ => {
                    members.push(Vec::with_capacity(unit));
                    windows.push(is_local.then_some(window));
                    members.len() - 1
                }
            };
            open[kind] = Some(g);
            place.push((g, members[g].len()));
            members[g].push(l);
        }
        Self { place, members, windows }
    }

    /// Groups: pool blocks per logical block.
    pub fn count(&self) -> usize {
        self.windows.len()
    }

    /// Model layers placed.
    pub fn layers(&self) -> usize {
        self.place.len()
    }

    /// Layers per pool block.
    pub fn unit(&self) -> usize {
        self.members[0].len()
    }

    /// Whether a pool block is a whole logical block (one group).
    pub fn is_whole(&self) -> bool {
        self.count() == 1
    }

    /// `(group, index in the group's block)` of model layer `layer`.
    pub fn place(&self, layer: usize) -> (usize, usize) {
        self.place[layer]
    }

    /// The window of `group`'s layers, `None` when they attend to every token.
    pub fn window(&self, group: usize) -> Option<usize> {
        self.windows[group]
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
