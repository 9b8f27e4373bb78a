//! GGUF metadata values and the ggml tensor type table.

use crate::quant::DType;

/// Metadata value type ids as stored in the file (`gguf_type`).
pub(crate) mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements share one type. Stored typed so that a 50k-entry vocabulary
/// costs what its strings cost, not 50k tagged values.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Arrays of arrays (each inner array may have its own element type).
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The GGUF name of the value's type (`u32`, `string`, `array of i32`, ...), for messages.
    pub fn type_name(&self) -> String {
        match self {
            Value::U8(_) => "u8".into(),
            Value::I8(_) => "i8".into(),
            Value::U16(_) => "u16".into(),
            Value::I16(_) => "i16".into(),
            Value::U32(_) => "u32".into(),
            Value::I32(_) => "i32".into(),
            Value::F32(_) => "f32".into(),
            Value::Bool(_) => "bool".into(),
            Value::String(_) => "string".into(),
            Value::Array(a) => format!("array of {}", a.element_type_name()),
            Value::U64(_) => "u64".into(),
            Value::I64(_) => "i64".into(),
            Value::F64(_) => "f64".into(),
        }
    }

    /// The value as a non-negative integer, whatever its integer width; `None` for other types
    /// and for negative values.
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

    /// The value as a float (f32 or f64 values only).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GGUF name of the element type.
    pub fn element_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::F32(_) => "f32",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F64(_) => "f64",
        }
    }
}

/// The ggml tensor type ids LeanStream reads, with their [`DType`].
const SUPPORTED: [(u32, DType); 13] = [
    (0, DType::F32),
    (1, DType::F16),
    (2, DType::Q4_0),
    (3, DType::Q4_1),
    (6, DType::Q5_0),
    (7, DType::Q5_1),
    (8, DType::Q8_0),
    (10, DType::Q2K),
    (11, DType::Q3K),
    (12, DType::Q4K),
    (13, DType::Q5K),
    (14, DType::Q6K),
    (30, DType::Bf16),
];

/// The element type of ggml type id `id`, or `None` when LeanStream does not support it.
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    SUPPORTED.iter().find(|(i, _)| *i == id).map(|(_, d)| *d)
}

/// The ggml type id of `dtype` (what the writer stores).
pub fn ggml_type_of(dtype: DType) -> u32 {
    SUPPORTED
        .iter()
        .find(|(_, d)| *d == dtype)
        .map(|(i, _)| *i)
        .expect("every DType has a ggml type id in SUPPORTED")
}

/// Names of the supported ggml types, in the order messages list them.
pub(crate) const SUPPORTED_NAMES: &str =
    "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k";

/// The ggml name of type id `id` (`q4_k`, `iq2_xs`, ...), or `unknown` for ids ggml never used.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "f32",
        "f16",
        "q4_0",
        "q4_1",
        "q4_2",
        "q4_3",
        "q5_0",
        "q5_1",
        "q8_0",
        "q8_1",
        "q2_k",
        "q3_k",
        "q4_k",
        "q5_k",
        "q6_k",
        "q8_k",
        "iq2_xxs",
        "iq2_xs",
        "iq3_xxs",
        "iq1_s",
        "iq4_nl",
        "iq3_s",
        "iq2_s",
        "iq4_xs",
        "i8",
        "i16",
        "i32",
        "i64",
        "f64",
        "iq1_m",
        "bf16",
        "q4_0_4_4",
        "q4_0_4_8",
        "q4_0_8_8",
        "tq1_0",
        "tq2_0",
        "iq4_nl_4_4",
        "iq4_nl_4_8",
        "iq4_nl_8_8",
        "mxfp4",
    ];
    usize::try_from(id)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("unknown")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn type_table_round_trips() {
        for (id, dtype) in SUPPORTED {
            assert_eq!(dtype_from_ggml(id), Some(dtype));
            assert_eq!(ggml_type_of(dtype), id);
            assert_eq!(ggml_type_name(id), dtype.name());
        }
        assert_eq!(ggml_type_name(12), "q4_k");
        assert_eq!(ggml_type_name(1000), "unknown");
        assert_eq!(dtype_from_ggml(12), Some(DType::Q4K));
        assert_eq!(dtype_from_ggml(23), None, "iq4_xs is not read");
    }

    #[test]
    fn integer_values_widen_but_negative_ones_do_not() {
        assert_eq!(Value::U8(7).as_u64(), Some(7));
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(
            Value::Array(Array::I32(vec![1])).type_name(),
            "array of i32"
        );
    }
}
