//! The GGUF writer (version 3 by default): metadata, tensor directory and tensor data with the
//! file's alignment, written as a stream.
//!
//! A file is laid out from what is declared before anything is written: every tensor's type and
//! shape fix its byte length, so the offsets of the directory follow from the declarations and
//! the alignment. [`GgufWriter::write_to`] then writes the header (metadata and directory) and
//! the tensor data one tensor at a time, in declaration order. A tensor's bytes are either held
//! by the writer (given to [`GgufWriter::add_tensor`]: tests, fuzz seeds, tiny models) or
//! written when its turn comes by a caller-supplied source into a [`TensorSink`] (declared with
//! [`GgufWriter::add_streamed_tensor`]: `leanstream export-gguf`, which never holds more than a
//! layer of a multi-gigabyte model). [`GgufWriter::write_file`] writes `PATH.partial` and renames
//! it into place only when complete.
//!
//! It writes what it is given; it does not check that the metadata describes a runnable model.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::reader::{DEFAULT_ALIGNMENT, MAGIC};
use super::value::{Array, Value, ggml_type_of, type_id};
use crate::quant::DType;
use crate::{Error, Result};

/// Where a tensor's bytes come from.
#[derive(Clone, Debug)]
enum Data {
    /// Given up front, held by the writer.
    Held(Vec<u8>),
    /// Written by the source passed to [`GgufWriter::write_to`]: exactly this many bytes.
    Streamed(u64),
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    ggml_type: u32,
    /// GGUF order: innermost first.
    ne: Vec<u64>,
    data: Data,
}

impl PendingTensor {
    fn len(&self) -> u64 {
        match &self.data {
            Data::Held(b) => b.len() as u64,
            Data::Streamed(n) => *n,
        }
    }
}

/// Where a tensor source writes one tensor's bytes; I/O errors name the output file.
pub struct TensorSink<'a> {
    out: &'a mut dyn Write,
    path: &'a Path,
    written: u64,
}

impl std::fmt::Debug for TensorSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorSink")
            .field("path", &self.path)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

impl TensorSink<'_> {
    /// Appends `bytes` to the tensor.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(self.path, e))?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Bytes written to this tensor so far.
    pub fn written(&self) -> u64 {
        self.written
    }
}

/// Writes the data of streamed tensors: called once per streamed tensor, in declaration order,
/// with its index among all tensors, its name and the sink for exactly its declared length.
pub type TensorSource<'a> = dyn FnMut(usize, &str, &mut TensorSink) -> Result<()> + 'a;

/// Collects metadata and tensor declarations, then writes a GGUF file.
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

/// Bytes of a tensor of `dtype` with `shape` outermost first, or `None` when its rows are not a
/// whole number of blocks.
fn tensor_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    let cols = shape.last().copied().unwrap_or(1);
    let rows: usize = shape.iter().rev().skip(1).product();
    dtype.row_bytes(cols)?.checked_mul(rows)
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
        assert_eq!(
            tensor_bytes(dtype, shape),
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
        self.push(name, ggml_type, shape, Data::Held(data))
    }

    /// Declares a tensor of `dtype` with `shape` outermost first whose bytes the source passed to
    /// [`GgufWriter::write_to`] writes when its turn comes. Fails when the rows are not a whole
    /// number of `dtype` blocks.
    pub fn add_streamed_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<&mut Self> {
        let len = tensor_bytes(dtype, shape).ok_or_else(|| Error::InvalidArgument {
            arg: "shape",
            reason: format!("tensor `{name}`: {shape:?} is not whole {dtype} blocks"),
        })?;
        Ok(self.push(name, ggml_type_of(dtype), shape, Data::Streamed(len as u64)))
    }

    fn push(&mut self, name: &str, ggml_type: u32, shape: &[usize], data: Data) -> &mut Self {
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

    fn alignment(&self) -> u64 {
        self.kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT as u64)
    }

    /// Offset of each tensor from the start of the data section, in declaration order.
    pub fn tensor_offsets(&self) -> Vec<u64> {
        let align = self.alignment();
        let mut offset = 0u64;
        self.tensors
            .iter()
            .map(|t| {
                let at = offset;
                offset = (offset + t.len()).next_multiple_of(align);
                at
            })
            .collect()
    }

    /// Bytes of the data section: every tensor, each padded to the alignment.
    pub fn data_len(&self) -> u64 {
        let align = self.alignment();
        self.tensors
            .iter()
            .map(|t| t.len().next_multiple_of(align))
            .sum()
    }

    /// Magic, version, counts, metadata and the tensor directory, padded to the alignment.
    fn header(&self) -> Vec<u8> {
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
        for (t, offset) in self.tensors.iter().zip(self.tensor_offsets()) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(self.alignment() as usize), 0);
        out
    }

    /// Writes the whole file to `out`: the header, then each tensor's data padded to the
    /// alignment, held bytes as they are and streamed tensors by calling `source`. `path` names
    /// the destination in errors. Fails, naming the tensor, when `source` writes another number
    /// of bytes than the tensor declared. Returns the bytes written.
    pub fn write_to(
        &self,
        path: &Path,
        out: &mut dyn Write,
        source: &mut TensorSource,
    ) -> Result<u64> {
        const ZEROS: [u8; 64] = [0; 64];
        let align = self.alignment();
        let header = self.header();
        out.write_all(&header).map_err(|e| Error::io(path, e))?;
        let mut total = header.len() as u64;
        for (i, t) in self.tensors.iter().enumerate() {
            let mut sink = TensorSink {
                out: &mut *out,
                path,
                written: 0,
            };
            match &t.data {
                Data::Held(bytes) => sink.write(bytes)?,
                Data::Streamed(len) => {
                    source(i, &t.name, &mut sink)?;
                    if sink.written != *len {
                        return Err(Error::Tensor {
                            path: path.to_path_buf(),
                            tensor: t.name.clone(),
                            reason: format!(
                                "its source wrote {} bytes, the directory says {len}",
                                sink.written
                            ),
                        });
                    }
                }
            }
            let mut pad = t.len().next_multiple_of(align) - t.len();
            while pad > 0 {
                let n = pad.min(ZEROS.len() as u64);
                sink.write(&ZEROS[..n as usize])?;
                pad -= n;
            }
            total += sink.written;
        }
        out.flush().map_err(|e| Error::io(path, e))?;
        Ok(total)
    }

    /// Writes the file to `path` through `PATH.partial` (synced, then renamed into place; removed
    /// on failure, so no half-written file is left under either name). Returns the file's bytes.
    pub fn write_file(&self, path: &Path, source: &mut TensorSource) -> Result<u64> {
        self.write_file_synced(path, source, true)
    }

    fn write_file_synced(&self, path: &Path, source: &mut TensorSource, sync: bool) -> Result<u64> {
        let partial = partial_path(path);
        let file = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let written = self.write_to(&partial, &mut out, source).and_then(|n| {
            let file = out
                .into_inner()
                .map_err(|e| Error::io(&partial, e.into_error()))?;
            if sync {
                file.sync_all().map_err(|e| Error::io(&partial, e))?;
            }
            Ok(n)
        });
        match written {
            Ok(n) => {
                std::fs::rename(&partial, path).map_err(|e| Error::io(path, e))?;
                Ok(n)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                Err(e)
            }
        }
    }

    /// The file's bytes. Panics if a tensor is streamed (its bytes come from a source: use
    /// [`GgufWriter::write_to`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(Path::new("<memory>"), &mut out, &mut no_source)
            .unwrap_or_else(|e| panic!("GgufWriter::to_bytes: {e}"));
        out
    }

    /// Writes a file whose tensors are all held (see [`GgufWriter::write_file`]).
    pub fn write(&self, path: &Path) -> Result<()> {
        self.write_file_synced(path, &mut no_source, false)
            .map(|_| ())
    }
}

/// The source of a writer whose tensors are all held: never called but for a streamed one.
fn no_source(_: usize, name: &str, _: &mut TensorSink) -> Result<()> {
    Err(Error::InvalidArgument {
        arg: "source",
        reason: format!("tensor `{name}` is streamed but no source was given"),
    })
}

/// `PATH.partial`: the name a file is written under until it is complete.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".partial");
    PathBuf::from(name)
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

    /// A writer with a held tensor between two streamed ones, and the bytes each should hold.
    fn mixed() -> (GgufWriter, Vec<Vec<u8>>) {
        let a: Vec<u8> = (0..3 * 34).map(|i| (i * 7 % 251) as u8).collect();
        let b: Vec<u8> = (0..5 * 4).map(|i| i as u8).collect();
        let c: Vec<u8> = (0..2 * 2 * 18).map(|i| (255 - i) as u8).collect();
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String("test".into()));
        w.add_streamed_tensor("a", DType::Q8_0, &[3, 32]).unwrap();
        w.add_tensor("b", DType::F32, &[5], b.clone());
        w.add_streamed_tensor("c", DType::Q4_0, &[2, 2, 32])
            .unwrap();
        (w, vec![a, b, c])
    }

    #[test]
    fn streamed_tensors_are_written_by_the_source_in_order_and_parse_back() {
        let (w, want) = mixed();
        let mut calls = Vec::new();
        let mut out = Vec::new();
        let n = w
            .write_to(Path::new("mem.gguf"), &mut out, &mut |i, name, sink| {
                calls.push((i, name.to_string()));
                // In pieces, as a real source writes.
                for piece in want[i].chunks(10) {
                    sink.write(piece)?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(calls, [(0, "a".to_string()), (2, "c".to_string())]);
        assert_eq!(n, out.len() as u64);
        let f = GgufFile::parse(Path::new("mem.gguf"), TensorBytes::from_vec(out)).unwrap();
        assert_eq!(f.data_start() as u64 + w.data_len(), n);
        for (name, (bytes, offset)) in ["a", "b", "c"]
            .iter()
            .zip(want.iter().zip(w.tensor_offsets()))
        {
            let info = f.tensor(name).unwrap();
            assert_eq!(info.offset, offset, "{name}");
            assert_eq!(&f.tensor_ref(info).unwrap().data[..], &bytes[..], "{name}");
        }
        assert_eq!(
            f.tensor_ref(f.tensor("c").unwrap()).unwrap().shape,
            [2, 2, 32]
        );
    }

    #[test]
    fn a_source_that_writes_the_wrong_length_fails_and_leaves_no_file() {
        let (w, want) = mixed();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.gguf");
        let e = w
            .write_file(&path, &mut |i, _, sink| sink.write(&want[i][1..]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor `a`") && e.contains("101 bytes"), "{e}");
        assert!(!path.exists() && !partial_path(&path).exists());
        let e = w
            .write_file(&path, &mut |_, name, _| {
                Err(Error::invalid_file("in.lsm", format!("bad {name}")))
            })
            .unwrap_err();
        assert!(e.to_string().contains("bad a"), "{e}");
        assert!(!path.exists() && !partial_path(&path).exists());
        // Without a source, streamed tensors cannot be written.
        let e = w.write(&path).unwrap_err().to_string();
        assert!(e.contains("`a` is streamed"), "{e}");
        // A good source: the file is in place, the partial one gone.
        let n = w
            .write_file(&path, &mut |i, _, sink| sink.write(&want[i]))
            .unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), n);
        assert!(!partial_path(&path).exists());
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.tensors().len(), 3);
    }

    #[test]
    fn a_shape_that_is_not_whole_blocks_cannot_be_declared() {
        let e = GgufWriter::new()
            .add_streamed_tensor("x", DType::Q8_0, &[2, 40])
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("`x`"), "{e}");
    }
}
