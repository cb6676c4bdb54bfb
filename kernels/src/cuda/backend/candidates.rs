//! The sampler's cut on the device (`Backend::candidates`): `candidates_rows` cuts each row
//! where the logits are, `candidates_pack` lays the rows out one after another, and two copies
//! bring back the offsets and then the pairs.

use super::{CudaBackend, DeviceVec, check_size, ok};
use crate::candidates::{Candidates, Cut, MAX_CANDIDATES};
use crate::cuda::{Arg, Device, Dims};

impl<D: Device> CudaBackend<D> {
    pub(super) fn cut_rows(
        &self,
        x: &DeviceVec,
        cols: usize,
        cuts: &[Cut],
        out: &mut Candidates,
    ) -> bool {
        let rows = cuts.len();
        assert!(cols > 0 && x.len >= rows * cols, "candidates: shape mismatch");
        check_size("candidates", rows * MAX_CANDIDATES * 2);
        out.clear();
        if rows == 0 {
            return true;
        }
        let packed_len = rows + 1 + 2 * rows * MAX_CANDIDATES;
        let cut_bytes: Vec<u8> = cuts
            .iter()
            .flat_map(|c| [c.scale.to_bits(), c.margin.to_bits(), c.top_k])
            .flat_map(u32::to_le_bytes)
            .collect();
        let mut st = self.staging();
        let cuts_arg = st.put(&*self.dev, "cuts", &cut_bytes);
        let per_row = st.cand_rows.ensure(&*self.dev, rows * (1 + 2 * MAX_CANDIDATES) * 4).addr();
        let packed = st.cand_packed.ensure(&*self.dev, packed_len * 4).clone();
        drop(st);
        let (counts, ids) = (Arg::Ptr(per_row), Arg::Ptr(per_row + rows as u64 * 4));
        let vals = Arg::Ptr(per_row + (rows * (1 + MAX_CANDIDATES)) as u64 * 4);
        let cap = Arg::int(MAX_CANDIDATES);
        let args = [x.ptr(), Arg::int(cols), cuts_arg, cap, counts, ids, vals];
        self.launch(
            "candidates_rows",
            Dims { grid: [rows as u32, 1, 1], block: [128, 1, 1] },
            &args,
        );
        let args = [Arg::int(rows), cap, counts, ids, vals, Arg::ptr(&packed)];
        self.launch("candidates_pack", Dims { grid: [1, 1, 1], block: [128, 1, 1] }, &args);
        let mut offsets = vec![0u32; rows + 1];
        ok(self.dev.dtoh(&packed, 0, bytemuck::cast_slice_mut(&mut offsets)));
        if offsets.windows(2).any(|w| (w[1] - w[0]) as usize > MAX_CANDIDATES) {
            return false;
        }
        let mut pairs = vec![0u32; 2 * offsets[rows] as usize];
        ok(self.dev.dtoh(&packed, (rows + 1) * 4, bytemuck::cast_slice_mut(&mut pairs)));
        out.offsets.clear();
        out.offsets.extend(offsets.iter().map(|&o| o as usize));
        out.items.extend(pairs.chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))));
        true
    }
}
