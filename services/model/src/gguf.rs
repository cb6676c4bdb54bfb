//! GGUF reader (versions 2 and 3): header, metadata, tensor table and alignment, over a
//! read-only memory map so weights stay quantized and paged in on demand.
//!
//! Every read is bounds-checked against the file: a truncated, corrupt or hostile file yields an
//! `Error::Gguf` naming the field, key or tensor and what is wrong — never a panic, never an
//! out-of-bounds read, never an allocation sized by an unchecked count.

use std::collections::BTreeMap;
use std::path::Path;

pub use types::GgmlType;

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;
/// Arrays nested deeper than this are refused (GGUF allows nesting; real files use one level).
const MAX_NESTING: usize = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The value as a non-negative integer, whatever integer type stored it.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// A tensor's entry in the table: where its bytes are and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub size: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Columns and rows when viewed as a matrix (higher dims fold into rows).
    pub fn matrix_shape(&self) -> (usize, usize) {
        let cols = self.dims.first().copied().unwrap_or(1) as usize;
        let rows = self.dims.iter().skip(1).product::<u64>() as usize;
        (cols, rows)
    }
}

/// An opened GGUF file: parsed header and tables over the mapped bytes.
pub struct GgufFile {
    /// Shared: the weights views the backends compute with keep the file alive.
    map: std::sync::Arc<Bytes>,
    pub version: u32,
    pub alignment: u64,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let io =
            |source| Error::Io { path: path.to_path_buf(), source: std::sync::Arc::new(source) };
        let file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::other("not a regular file")));
        }
        if meta.len() == 0 {
            return Err(Error::gguf("header", "file is empty"));
        }
        #[allow(unsafe_code)]
        // SAFETY: the map is read-only and private to this process. Model files are not
        // modified while served; if one were truncated underneath us reads could fault, the
        // same contract every mmap-based model loader (llama.cpp included) has.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(map: Bytes) -> Result<Self> {
        let data = map.as_slice();
        let mut r = Reader { data, pos: 0 };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(Error::gguf("magic", format!("expected \"GGUF\", found {magic:02x?}")));
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::gguf(
                    "version",
                    "GGUF v1 is not supported (re-convert the model)",
                ));
            }
            v if v.swap_bytes() <= 3 => {
                return Err(Error::gguf("version", "big-endian GGUF files are not supported"));
            }
            v => return Err(Error::gguf("version", format!("unsupported version {v}"))),
        }
        let n_tensors = r.u64("tensor_count")?;
        let n_kv = r.u64("metadata_kv_count")?;
        // Each metadata entry takes at least 13 bytes and each tensor entry at least 28, so a
        // count larger than the file allows is corrupt — refuse before allocating for it.
        r.check_count(n_kv, 13, "metadata_kv_count")?;
        r.check_count(n_tensors, 28, "tensor_count")?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata entry {i} key"))?;
            let ty = r.u32(&format!("metadata {key:?} type"))?;
            let value = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(Error::gguf(format!("metadata {key:?}"), "duplicate key"));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(Error::gguf(
                        "metadata \"general.alignment\"",
                        format!("must be a power of two up to 1 MiB, got {v:?}"),
                    ));
                }
            },
        };

        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor {i} name"))?;
            let ctx = format!("tensor {name:?}");
            let n_dims = r.u32(&format!("{ctx} n_dims"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::gguf(
                    &ctx,
                    format!("{n_dims} dimensions (expected 1..={MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                let v = r.u64(&format!("{ctx} dim {d}"))?;
                if v == 0 {
                    return Err(Error::gguf(&ctx, format!("dimension {d} is zero")));
                }
                dims.push(v);
            }
            let ty_id = r.u32(&format!("{ctx} type"))?;
            let offset = r.u64(&format!("{ctx} offset"))?;
            raw.push((name, dims, ty_id, offset));
        }
        let data_start = align_up(r.pos as u64, alignment)
            .ok_or_else(|| Error::gguf("tensor data", "offset overflows"))?;
        let file_len = data.len() as u64;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = BTreeMap::new();
        for (name, dims, ty_id, offset) in raw {
            let ctx = format!("tensor {name:?}");
            let ty = ggml_type(ty_id).map_err(|problem| Error::gguf(&ctx, problem))?;
            let elements = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| Error::gguf(&ctx, format!("shape {dims:?} overflows")))?;
            if dims[0] % ty.block_elems() as u64 != 0 {
                return Err(Error::gguf(
                    &ctx,
                    format!(
                        "first dimension {} is not a multiple of the {ty} block size {}",
                        dims[0],
                        ty.block_elems()
                    ),
                ));
            }
            let size = (elements / ty.block_elems() as u64)
                .checked_mul(ty.block_bytes() as u64)
                .ok_or_else(|| Error::gguf(&ctx, "byte size overflows"))?;
            if offset % alignment != 0 {
                return Err(Error::gguf(
                    &ctx,
                    format!("data offset {offset} is not aligned to {alignment}"),
                ));
            }
            let start = data_start
                .checked_add(offset)
                .ok_or_else(|| Error::gguf(&ctx, "data offset overflows"))?;
            let end =
                start.checked_add(size).ok_or_else(|| Error::gguf(&ctx, "data end overflows"))?;
            if end > file_len {
                return Err(Error::gguf(
                    &ctx,
                    format!(
                        "data {start}..{end} lies past the end of the file ({file_len} bytes): truncated?"
                    ),
                ));
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::gguf(&ctx, "duplicate tensor name"));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset: start as usize,
                size: size as usize,
            });
        }
        let map = std::sync::Arc::new(map);
        Ok(Self { map, version, alignment, metadata, tensors, by_name })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_slice()
    }

    /// The file's bytes, shared: whoever holds them keeps the file mapped (the weights the
    /// backends compute with).
    pub fn shared(&self) -> std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> {
        self.map.clone()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes()[t.offset..t.offset + t.size]
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn wrong_type(key: &str, want: &str, v: &Value) -> Error {
        Error::gguf(
            format!("metadata {key:?}"),
            format!("expected {want}, found {}", v.type_name()),
        )
    }

    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| v.as_u64().ok_or_else(|| Self::wrong_type(key, "a non-negative integer", v)))
            .transpose()
    }

    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| Self::wrong_type(key, "a float", v)))
            .transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                other => Err(Self::wrong_type(key, "a bool", other)),
            })
            .transpose()
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(Self::wrong_type(key, "a string", other)),
            })
            .transpose()
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.get(key)
            .map(|v| match v {
                Value::Array(a) => Ok(a.as_slice()),
                other => Err(Self::wrong_type(key, "an array", other)),
            })
            .transpose()
    }

    /// A required key, with an error naming it when absent.
    pub fn require<T>(&self, key: &str, v: Result<Option<T>>) -> Result<T> {
        v?.ok_or_else(|| Error::gguf(format!("metadata {key:?}"), "missing"))
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// Maps a GGML type id to a supported weight type, or says which type it is and that it is not.
fn ggml_type(id: u32) -> std::result::Result<GgmlType, String> {
    GgmlType::from_gguf_id(id).map_err(|name| {
        let known: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
        format!("tensor type {id} ({name}) is not supported (supported: {})", known.join(", "))
    })
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::gguf(
                what,
                format!(
                    "needs {n} bytes at offset {} but the file ends at {}: truncated?",
                    self.pos,
                    self.data.len()
                ),
            ));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn check_count(&self, n: u64, min_size: u64, what: &str) -> Result<()> {
        if n.checked_mul(min_size).is_none_or(|need| need > self.remaining() as u64) {
            return Err(Error::gguf(
                what,
                format!("count {n} cannot fit in the {} bytes left", self.remaining()),
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(Error::gguf(
                what,
                format!("string length {len} runs past the end of the file"),
            ));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| Error::gguf(what, format!("invalid UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let ctx = || format!("metadata {key:?}");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&ctx())?[0]),
            1 => Value::I8(self.array::<1>(&ctx())?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&ctx())?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&ctx())?)),
            4 => Value::U32(self.u32(&ctx())?),
            5 => Value::I32(i32::from_le_bytes(self.array(&ctx())?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&ctx())?)),
            7 => match self.array::<1>(&ctx())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(Error::gguf(ctx(), format!("bool byte is {b}, not 0 or 1"))),
            },
            8 => Value::String(self.string(&ctx())?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(Error::gguf(ctx(), "arrays nested too deeply"));
                }
                let elem_ty = self.u32(&ctx())?;
                let len = self.u64(&ctx())?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => {
                        return Err(Error::gguf(
                            ctx(),
                            format!("unknown array element type {other}"),
                        ));
                    }
                };
                self.check_count(len, min, &ctx())?;
                let mut v = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&ctx())?),
            11 => Value::I64(i64::from_le_bytes(self.array(&ctx())?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&ctx())?)),
            other => return Err(Error::gguf(ctx(), format!("unknown value type {other}"))),
        })
    }
}

mod types;
pub mod writer;

#[cfg(test)]
mod tests {
    use super::writer::GgufBuilder;
    use super::*;

    fn sample() -> Vec<u8> {
        GgufBuilder::default()
            .kv("general.architecture", Value::String("llama".into()))
            .kv("llama.block_count", Value::U32(2))
            .kv(
                "tokenizer.ggml.tokens",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            )
            .kv("x.f", Value::F32(1.5))
            .tensor("w", &[32, 2], GgmlType::Q8_0, vec![7u8; 68])
            .tensor("n", &[3], GgmlType::F32, vec![0u8; 12])
            .build()
    }

    fn err(bytes: Vec<u8>) -> String {
        GgufFile::from_bytes(bytes).unwrap_err().to_string()
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(f.get_u64("llama.block_count").unwrap(), Some(2));
        assert_eq!(f.get_f64("x.f").unwrap(), Some(1.5));
        assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().unwrap().len(), 2);
        let w = f.tensor("w").unwrap();
        assert_eq!((w.ty, w.matrix_shape(), w.size), (GgmlType::Q8_0, (32, 2), 68));
        assert_eq!(f.tensor_data(w), &[7u8; 68][..]);
        assert_eq!(w.offset % 32, 0);
        assert!(f.tensor("missing").is_none());
    }

    #[test]
    fn wrong_metadata_type_names_the_key() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        let e = f.get_u64("general.architecture").unwrap_err().to_string();
        assert!(e.contains("general.architecture") && e.contains("string"), "{e}");
        let e = f.require("nope", f.get_u64("nope")).unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains("missing"), "{e}");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = sample();
        for len in 0..full.len() {
            let r = GgufFile::from_bytes(full[..len].to_vec());
            assert!(r.is_err(), "truncated to {len} bytes parsed");
        }
    }

    #[test]
    fn truncated_tensor_data_names_the_tensor() {
        let mut b = sample();
        b.truncate(b.len() - 4);
        let e = err(b);
        assert!(e.contains("tensor \"n\"") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn bad_magic_and_versions() {
        let mut b = sample();
        b[0] = b'X';
        assert!(err(b).contains("magic"));
        let mut b = sample();
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(err(b).contains("v1"));
        let mut b = sample();
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(err(b).contains("big-endian"));
        let mut b = sample();
        b[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(err(b).contains("unsupported version 9"));
    }

    #[test]
    fn absurd_counts_are_refused_before_allocating() {
        let mut b = sample();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(b).contains("tensor_count"));
        let mut b = sample();
        b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(err(b).contains("metadata_kv_count"));
    }

    #[test]
    fn unsupported_tensor_type_names_tensor_and_type() {
        let b = GgufBuilder::default()
            .tensor("blk.0.ffn_down.weight", &[256], GgmlType::F32, vec![0; 1024])
            .build();
        // Patch the type id (after name, n_dims, one dim): Q2_K, Q3_K and the IQ types are
        // refused by name.
        let name_end = 24 + 8 + "blk.0.ffn_down.weight".len();
        let ty_at = name_end + 4 + 8;
        for (id, name) in [(10u32, "Q2_K"), (11, "Q3_K"), (23, "IQ4_XS"), (99, "unknown")] {
            let mut b2 = b.clone();
            b2[ty_at..ty_at + 4].copy_from_slice(&id.to_le_bytes());
            let e = err(b2);
            assert!(e.contains("blk.0.ffn_down.weight") && e.contains(name), "{e}");
            assert!(e.contains("Q4_K") && e.contains("Q6_K"), "lists what is supported: {e}");
        }
    }

    #[test]
    fn malformed_entries() {
        // A dimension that is not a whole number of blocks.
        let e = err(GgufBuilder::default().tensor("t", &[48], GgmlType::Q4_1, vec![0; 40]).build());
        assert!(e.contains("tensor \"t\"") && e.contains("block size"), "{e}");
        // A zero dimension.
        let e = err(GgufBuilder::default().tensor("z", &[0, 4], GgmlType::F32, vec![]).build());
        assert!(e.contains("dimension 0 is zero"), "{e}");
        // Duplicate keys and tensors.
        let e = err(GgufBuilder::default().kv("k", Value::U8(1)).kv("k", Value::U8(2)).build());
        assert!(e.contains("duplicate key"), "{e}");
        let e = err(GgufBuilder::default()
            .tensor("d", &[1], GgmlType::F32, vec![0; 4])
            .tensor("d", &[1], GgmlType::F32, vec![0; 4])
            .build());
        assert!(e.contains("duplicate tensor"), "{e}");
        // A bool that is neither 0 nor 1.
        let mut b = GgufBuilder::default().kv("flag", Value::Bool(true)).build();
        let at = 24 + 8 + "flag".len() + 4; // header, key, value type
        assert_eq!(b[at], 1);
        b[at] = 7;
        assert!(err(b).contains("bool byte is 7"));
        // Invalid UTF-8 in a string value.
        let mut b = GgufBuilder::default().kv("s", Value::String("ok".into())).build();
        let at = 24 + 8 + 1 + 4 + 8 + 1; // header, key, type, length, "o"
        assert_eq!(b[at], b'k');
        b[at] = 0xFF;
        let e = err(b);
        assert!(e.contains("\"s\"") && e.contains("UTF-8"), "{e}");
        // A bad alignment value.
        let e = err(GgufBuilder::default().kv("general.alignment", Value::U32(3)).build());
        assert!(e.contains("general.alignment"), "{e}");
    }

    #[test]
    fn arbitrary_corruption_never_panics() {
        // Deterministic byte flips over the whole header: any outcome but a panic is fine.
        let base = sample();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..4000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut b = base.clone();
            let i = (state % b.len() as u64) as usize;
            b[i] = (state >> 32) as u8;
            let _ = GgufFile::from_bytes(b);
        }
    }
}
