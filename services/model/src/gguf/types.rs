//! The tensor types a GGUF file names (`ggml_type`): which ones pdmesh reads, with the block
//! geometry that sizes a tensor in the file, and the names of the rest for the error that
//! refuses them. The kernels implement each readable type once; the engine's test
//! `ggml_types_match_the_kernels` holds the two lists to the same ids, names and geometry.

/// A tensor storage type pdmesh reads from GGUF.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// (type, GGUF id, name, elements per block, bytes per block), floats first.
const TABLE: [(GgmlType, u32, &str, usize, usize); 11] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
];

impl GgmlType {
    /// Every type, floats first.
    pub const ALL: [GgmlType; 11] = {
        let mut all = [GgmlType::F32; 11];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].0;
            i += 1;
        }
        all
    };

    const fn entry(self) -> (GgmlType, u32, &'static str, usize, usize) {
        TABLE[self as usize]
    }

    /// The `ggml_type` id GGUF stores.
    pub const fn gguf_id(self) -> u32 {
        self.entry().1
    }

    pub const fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per storage block (1 for the float types).
    pub const fn block_elems(self) -> usize {
        self.entry().3
    }

    /// Bytes per storage block.
    pub const fn block_bytes(self) -> usize {
        self.entry().4
    }

    /// The type GGUF id `id` names, or `Err` with that type's name when pdmesh does not read it.
    pub fn from_gguf_id(id: u32) -> Result<Self, &'static str> {
        match TABLE.iter().find(|e| e.1 == id) {
            Some(e) => Ok(e.0),
            None => Err(unsupported_name(id)),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Names of GGUF tensor types pdmesh does not compute with, for the load error.
fn unsupported_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_declaration_order_and_ids_are_unique() {
        for (i, e) in TABLE.iter().enumerate() {
            assert_eq!(e.0 as usize, i, "{}", e.2);
            assert_eq!(GgmlType::from_gguf_id(e.1), Ok(e.0));
            assert_eq!(format!("{:?}", e.0), e.2, "Debug is the name: fingerprints hash it");
        }
        assert_eq!(GgmlType::from_gguf_id(10), Err("Q2_K"));
        assert_eq!(GgmlType::from_gguf_id(999), Err("unknown"));
    }
}
