//! Builds GGUF images in memory: for tests of the reader and of the engine on synthetic models.

use super::GgmlType;
use super::Value;

/// An in-memory GGUF v3 image under construction.
#[derive(Debug, Default)]
pub struct GgufBuilder {
    kv: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufBuilder {
    pub fn kv(mut self, key: &str, v: Value) -> Self {
        self.kv.push((key.to_string(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty.gguf_id(), data));
        self
    }

    /// Sets `key`, replacing its value when it is there already.
    pub fn set_kv(mut self, key: &str, v: Value) -> Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.kv.push((key.to_string(), v)),
        }
        self
    }

    /// Drops `key` (no-op when absent).
    pub fn remove_kv(mut self, key: &str) -> Self {
        self.kv.retain(|(k, _)| k != key);
        self
    }

    /// Changes the bytes of tensor `name` in place (a test varying one weight); no-op when absent.
    pub fn map_tensor(mut self, name: &str, f: impl FnOnce(&mut Vec<u8>)) -> Self {
        if let Some(t) = self.tensors.iter_mut().find(|t| t.0 == name) {
            f(&mut t.3);
        }
        self
    }

    /// Drops every tensor whose name `drop` accepts.
    pub fn remove_tensors(mut self, drop: impl Fn(&str) -> bool) -> Self {
        self.tensors.retain(|t| !drop(&t.0));
        self
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn put_value(out: &mut Vec<u8>, v: &Value, with_type: bool) {
        let (ty, body): (u32, Vec<u8>) = match v {
            Value::U8(x) => (0, vec![*x]),
            Value::I8(x) => (1, vec![*x as u8]),
            Value::U16(x) => (2, x.to_le_bytes().to_vec()),
            Value::I16(x) => (3, x.to_le_bytes().to_vec()),
            Value::U32(x) => (4, x.to_le_bytes().to_vec()),
            Value::I32(x) => (5, x.to_le_bytes().to_vec()),
            Value::F32(x) => (6, x.to_le_bytes().to_vec()),
            Value::Bool(x) => (7, vec![u8::from(*x)]),
            Value::String(s) => {
                let mut b = Vec::new();
                Self::put_str(&mut b, s);
                (8, b)
            }
            Value::Array(items) => {
                let mut b = Vec::new();
                let elem = items.first().map_or(4, Self::type_of);
                b.extend_from_slice(&elem.to_le_bytes());
                b.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    Self::put_value(&mut b, it, false);
                }
                (9, b)
            }
            Value::U64(x) => (10, x.to_le_bytes().to_vec()),
            Value::I64(x) => (11, x.to_le_bytes().to_vec()),
            Value::F64(x) => (12, x.to_le_bytes().to_vec()),
        };
        if with_type {
            out.extend_from_slice(&ty.to_le_bytes());
        }
        out.extend_from_slice(&body);
    }

    fn type_of(v: &Value) -> u32 {
        let mut b = Vec::new();
        Self::put_value(&mut b, v, true);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// The file image (alignment 32).
    pub fn build(self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            Self::put_str(&mut out, k);
            Self::put_value(&mut out, v, true);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            Self::put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        let base = out.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }
}
