//! The float formats: F32, F16 and BF16, read element by element.

use half::{bf16, f16};

use super::{FloatFormat, FloatKind, Format};

#[derive(Debug)]
pub struct F32;
#[derive(Debug)]
pub struct F16;
#[derive(Debug)]
pub struct BF16;

macro_rules! float_format {
    ($t:ident, $name:literal, $id:literal, $bytes:literal, |$b:ident| $at:expr) => {
        impl Format for $t {
            const NAME: &'static str = $name;
            const GGUF_ID: u32 = $id;
            const BLOCK_ELEMS: usize = 1;
            const BLOCK_BYTES: usize = $bytes;
            fn dequantize(block: &[u8], out: &mut [f32]) {
                out[0] = Self::at(block);
            }
        }
        impl FloatFormat for $t {
            const KIND: FloatKind = FloatKind::$t;
            #[inline(always)]
            fn at($b: &[u8]) -> f32 {
                $at
            }
        }
    };
}

float_format!(F32, "F32", 0, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
float_format!(F16, "F16", 1, 2, |b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
float_format!(BF16, "BF16", 30, 2, |b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
