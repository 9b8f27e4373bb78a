//! A small GGUF writer (version 3 by default): metadata and tensors with correct alignment.
//!
//! Used by tests, fuzz seeds and generated scale models. It writes what it is given; it does not
//! check that the metadata describes a runnable model.

use std::path::Path;

pub use super::tiny::{TinyArch, TinyLlama, tiny_llama};

use super::reader::{DEFAULT_ALIGNMENT, MAGIC};
use super::value::{Array, Value, ggml_type_of, type_id};
use crate::quant::DType;
use crate::{Error, Result};

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    ggml_type: u32,
    /// GGUF order: innermost first.
    ne: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes a GGUF file.
///
/// The data alignment is taken from a `general.alignment` entry when one is added (it must be a
/// power of two), else 32 bytes.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    kvs: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the version field written in the header (any value, so tests can write bad files).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Adds (or replaces) a metadata entry.
    pub fn add(&mut self, key: &str, value: Value) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self.kvs.push((key.to_string(), value));
        self
    }

    /// Removes a metadata entry if present.
    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    /// Adds a tensor of `dtype` with `shape` outermost first (`[rows, cols]`) and its stored
    /// bytes. Panics if `data` is not exactly the size of that shape (a bug in the caller).
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> &mut Self {
        let cols = shape.last().copied().unwrap_or(1);
        let rows: usize = shape.iter().rev().skip(1).product();
        let want = dtype.row_bytes(cols).map(|rb| rb * rows);
        assert_eq!(
            want,
            Some(data.len()),
            "tensor {name}: {} bytes for {dtype} {shape:?}",
            data.len()
        );
        self.add_raw_tensor(name, ggml_type_of(dtype), shape, data)
    }

    /// Adds `values` (row-major, `shape` outermost first) quantised to `dtype`.
    pub fn add_f32_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        values: &[f32],
    ) -> &mut Self {
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut data = Vec::new();
        for row in values.chunks(cols) {
            crate::quant::quantize_row(dtype, row, &mut data);
        }
        self.add_tensor(name, dtype, shape, data)
    }

    /// Adds a tensor with any ggml type id and unchecked bytes (for unsupported-type tests).
    pub fn add_raw_tensor(
        &mut self,
        name: &str,
        ggml_type: u32,
        shape: &[usize],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.retain(|t| t.name != name);
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ggml_type,
            ne: shape.iter().rev().map(|&d| d as u64).collect(),
            data,
        });
        self
    }

    /// Removes a tensor if present.
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.name != name);
        self
    }

    fn alignment(&self) -> usize {
        self.kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .and_then(|a| usize::try_from(a).ok())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment();
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        out.resize(out.len().next_multiple_of(align), 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().next_multiple_of(align), 0);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|e| Error::io(path, e))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => type_id::U8,
        Value::I8(_) => type_id::I8,
        Value::U16(_) => type_id::U16,
        Value::I16(_) => type_id::I16,
        Value::U32(_) => type_id::U32,
        Value::I32(_) => type_id::I32,
        Value::F32(_) => type_id::F32,
        Value::Bool(_) => type_id::BOOL,
        Value::String(_) => type_id::STRING,
        Value::Array(_) => type_id::ARRAY,
        Value::U64(_) => type_id::U64,
        Value::I64(_) => type_id::I64,
        Value::F64(_) => type_id::F64,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    macro_rules! each {
        ($ty:expr, $v:expr, $put:expr) => {{
            out.extend_from_slice(&$ty.to_le_bytes());
            out.extend_from_slice(&($v.len() as u64).to_le_bytes());
            for x in $v {
                $put(out, x);
            }
        }};
    }
    let le = |out: &mut Vec<u8>, b: &[u8]| out.extend_from_slice(b);
    match a {
        Array::U8(v) => each!(type_id::U8, v, |o: &mut Vec<u8>, x: &u8| o.push(*x)),
        Array::I8(v) => each!(type_id::I8, v, |o: &mut Vec<u8>, x: &i8| le(
            o,
            &x.to_le_bytes()
        )),
        Array::U16(v) => each!(type_id::U16, v, |o: &mut Vec<u8>, x: &u16| le(
            o,
            &x.to_le_bytes()
        )),
        Array::I16(v) => each!(type_id::I16, v, |o: &mut Vec<u8>, x: &i16| le(
            o,
            &x.to_le_bytes()
        )),
        Array::U32(v) => each!(type_id::U32, v, |o: &mut Vec<u8>, x: &u32| le(
            o,
            &x.to_le_bytes()
        )),
        Array::I32(v) => each!(type_id::I32, v, |o: &mut Vec<u8>, x: &i32| le(
            o,
            &x.to_le_bytes()
        )),
        Array::F32(v) => each!(type_id::F32, v, |o: &mut Vec<u8>, x: &f32| le(
            o,
            &x.to_le_bytes()
        )),
        Array::Bool(v) => each!(type_id::BOOL, v, |o: &mut Vec<u8>, x: &bool| o
            .push(u8::from(*x))),
        Array::String(v) => each!(type_id::STRING, v, |o: &mut Vec<u8>, x: &String| put_str(
            o, x
        )),
        Array::Array(v) => each!(type_id::ARRAY, v, put_array),
        Array::U64(v) => each!(type_id::U64, v, |o: &mut Vec<u8>, x: &u64| le(
            o,
            &x.to_le_bytes()
        )),
        Array::I64(v) => each!(type_id::I64, v, |o: &mut Vec<u8>, x: &i64| le(
            o,
            &x.to_le_bytes()
        )),
        Array::F64(v) => each!(type_id::F64, v, |o: &mut Vec<u8>, x: &f64| le(
            o,
            &x.to_le_bytes()
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly on purpose
mod tests {
    use super::*;
    use crate::model::TensorBytes;
    use crate::model::gguf::GgufFile;

    #[test]
    fn every_value_type_round_trips() {
        let values = [
            Value::U8(1),
            Value::I8(-2),
            Value::U16(3),
            Value::I16(-4),
            Value::U32(5),
            Value::I32(-6),
            Value::F32(7.5),
            Value::Bool(true),
            Value::String("acht".into()),
            Value::U64(9),
            Value::I64(-10),
            Value::F64(11.25),
            Value::Array(Array::I32(vec![1, -2, 3])),
            Value::Array(Array::String(vec!["a".into(), String::new()])),
            Value::Array(Array::Array(vec![
                Array::U8(vec![1, 2]),
                Array::Bool(vec![false]),
            ])),
            Value::Array(Array::F64(vec![])),
        ];
        let mut w = GgufWriter::new();
        for (i, v) in values.iter().enumerate() {
            w.add(&format!("k.{i:02}"), v.clone());
        }
        w.add("general.alignment", Value::U32(64));
        w.add_f32_tensor("t", DType::F32, &[2, 3], &[1., 2., 3., 4., 5., 6.]);
        w.add_f32_tensor("q", DType::Q8_0, &[1, 32], &[0.5; 32]);
        let path = Path::new("mem.gguf");
        let f = GgufFile::parse(path, TensorBytes::from_vec(w.to_bytes())).unwrap();
        for (i, v) in values.iter().enumerate() {
            assert_eq!(f.value(&format!("k.{i:02}")), Some(v));
        }
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_start() % 64, 0);
        let t = f.tensor_ref(f.tensor("t").unwrap()).unwrap();
        assert_eq!(t.shape, [2, 3]);
        assert_eq!(&t.data[4..8], &2f32.to_le_bytes());
        let q = f.tensor("q").unwrap();
        assert_eq!(q.offset % 64, 0);
        assert_eq!(f.tensor_ref(q).unwrap().data.len(), 34);
    }
}
