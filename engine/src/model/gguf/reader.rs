//! GGUF parsing: header, metadata, tensor infos and the data section, every size and offset
//! checked against the bytes actually present.
//!
//! Layout (all little-endian): magic `GGUF`, version `u32` (2 or 3), tensor count `u64`, metadata
//! count `u64`, the metadata entries (key string, value type `u32`, value), the tensor infos (name,
//! `n_dims: u32`, `ne: [u64; n_dims]` innermost first, ggml type `u32`, offset `u64` relative to
//! the data section), padding to `general.alignment`, then the data section.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::value::{self, Array, SUPPORTED_NAMES, Value, type_id};
use crate::model::{TensorBytes, TensorRef, read_file};
use crate::quant::DType;
use crate::{Error, Result};

/// The four magic bytes at the start of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Most dimensions a GGUF tensor may have.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays we accept (real files use at most 2).
const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's description from the tensor-info table.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// The raw ggml type id; see [`GgufTensorInfo::dtype`].
    pub ggml_type: u32,
    /// Shape, outermost first (GGUF's `ne` reversed), so a matrix is `[rows, cols]`.
    pub shape: Vec<usize>,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The element type, or `None` when the ggml type is not one LeanStream reads.
    pub fn dtype(&self) -> Option<DType> {
        value::dtype_from_ggml(self.ggml_type)
    }

    /// Number of elements (the product of the shape; checked for overflow at parse time).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed GGUF file. Tensor data is not copied: [`GgufFile::tensor_ref`] hands out slices of
/// the file's bytes.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    alignment: usize,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<GgufTensorInfo>,
    data_start: usize,
    bytes: TensorBytes,
}

/// A bounds-checked little-endian cursor. Errors are reasons without the path; the caller adds
/// the path and what was being read.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {what} at byte {} needs {n} bytes but only {} remain",
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count or length, checked to fit `usize`.
    fn len(&mut self, what: &str) -> Result<usize, String> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| format!("{what} {v} does not fit in memory"))
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.len("string length")?;
        if n > self.remaining() {
            return Err(format!(
                "truncated or corrupt: {what} at byte {} claims {n} bytes but only {} remain",
                self.pos,
                self.remaining()
            ));
        }
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not valid UTF-8"))
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in what is left.
    fn check_count(&self, count: usize, min_size: usize, what: &str) -> Result<(), String> {
        let fits = count
            .checked_mul(min_size)
            .is_some_and(|need| need <= self.remaining());
        if fits {
            Ok(())
        } else {
            Err(format!(
                "truncated or corrupt: {what} count {count} cannot fit in the {} bytes that remain",
                self.remaining()
            ))
        }
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            type_id::U8 => Value::U8(u8::from_le_bytes(self.array("u8 value")?)),
            type_id::I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            type_id::U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            type_id::I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            type_id::U32 => Value::U32(self.u32("u32 value")?),
            type_id::I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            type_id::F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            type_id::BOOL => Value::Bool(self.bool()?),
            type_id::STRING => Value::String(self.string("string value")?),
            type_id::ARRAY => Value::Array(self.array_value(depth)?),
            type_id::U64 => Value::U64(self.u64("u64 value")?),
            type_id::I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            type_id::F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }

    fn bool(&mut self) -> Result<bool, String> {
        match self.array::<1>("bool value")?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(format!("bool value is {b}, not 0 or 1")),
        }
    }

    fn array_value(&mut self, depth: usize) -> Result<Array, String> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!(
                "arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
            ));
        }
        let ty = self.u32("array element type")?;
        let n = self.len("array length")?;
        let min_size = match ty {
            type_id::U8 | type_id::I8 | type_id::BOOL => 1,
            type_id::U16 | type_id::I16 => 2,
            type_id::U32 | type_id::I32 | type_id::F32 => 4,
            type_id::U64 | type_id::I64 | type_id::F64 | type_id::STRING => 8,
            type_id::ARRAY => 12,
            other => return Err(format!("unknown array element type {other}")),
        };
        self.check_count(n, min_size, "array element")?;
        // Fixed-size elements: decode straight from one checked slice.
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.take(n * min_size, "array elements")?;
                Array::$variant(
                    raw.chunks_exact(min_size)
                        .map(|c| {
                            let mut b = [0u8; std::mem::size_of::<$t>()];
                            b.copy_from_slice(c);
                            <$t>::from_le_bytes(b)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            type_id::U8 => fixed!(U8, u8),
            type_id::I8 => fixed!(I8, i8),
            type_id::U16 => fixed!(U16, u16),
            type_id::I16 => fixed!(I16, i16),
            type_id::U32 => fixed!(U32, u32),
            type_id::I32 => fixed!(I32, i32),
            type_id::F32 => fixed!(F32, f32),
            type_id::U64 => fixed!(U64, u64),
            type_id::I64 => fixed!(I64, i64),
            type_id::F64 => fixed!(F64, f64),
            type_id::BOOL => Array::Bool((0..n).map(|_| self.bool()).collect::<Result<_, _>>()?),
            type_id::STRING => Array::String(
                (0..n)
                    .map(|i| {
                        self.string("string")
                            .map_err(|e| format!("array element {i}: {e}"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            _ => Array::Array(
                (0..n)
                    .map(|i| {
                        self.array_value(depth + 1)
                            .map_err(|e| format!("array element {i}: {e}"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
        })
    }
}

impl GgufFile {
    /// Reads the file at `path` into owned memory and parses it.
    pub fn open(path: &Path) -> Result<GgufFile> {
        GgufFile::parse(path, read_file(path)?)
    }

    /// Parses GGUF bytes. `path` is only used in error messages. Never panics on malformed input:
    /// every count, length, offset and size is checked against the bytes present.
    pub fn parse(path: &Path, bytes: TensorBytes) -> Result<GgufFile> {
        let invalid = |reason: String| Error::invalid_file(path, reason);
        let mut r = Reader {
            buf: bytes.as_slice(),
            pos: 0,
        };
        let magic: [u8; 4] = r.array("magic").map_err(invalid)?;
        if magic != MAGIC {
            return Err(invalid(format!(
                "not a GGUF file: magic bytes are {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = r.u32("version").map_err(invalid)?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::unsupported(
                    path,
                    "GGUF version 1 (32-bit counts) is not supported; supported: 2, 3",
                ));
            }
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(Error::unsupported(
                    path,
                    "big-endian GGUF files are not supported",
                ));
            }
            v => {
                return Err(Error::unsupported(
                    path,
                    format!("GGUF version {v} is not supported; supported: 2, 3"),
                ));
            }
        }
        let n_tensors = r.len("tensor count").map_err(invalid)?;
        let n_kv = r.len("metadata count").map_err(invalid)?;
        // Minimum sizes: a KV is a key length, a type and one byte; a tensor info is a name
        // length, n_dims, one dim, a type and an offset.
        r.check_count(n_kv, 8 + 4 + 1, "metadata entry")
            .map_err(invalid)?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r
                .string("metadata key")
                .map_err(|e| invalid(format!("metadata entry {i}: {e}")))?;
            if key.is_empty() {
                return Err(invalid(format!("metadata entry {i} has an empty key")));
            }
            let value = r
                .u32("value type")
                .and_then(|ty| r.value(ty, 0))
                .map_err(|e| invalid(format!("metadata entry {i} (`{key}`): {e}")))?;
            if metadata.contains_key(&key) {
                return Err(invalid(format!("metadata key `{key}` appears twice")));
            }
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64().and_then(|a| usize::try_from(a).ok()) {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(invalid(format!(
                        "general.alignment must be a power of two, found {v:?}"
                    )));
                }
            },
        };

        r.check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor info")
            .map_err(invalid)?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut names = std::collections::HashSet::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info = read_tensor_info(&mut r, alignment)
                .map_err(|e| invalid(format!("tensor info {i}: {e}")))?;
            if !names.insert(info.name.clone()) {
                return Err(invalid(format!("tensor `{}` appears twice", info.name)));
            }
            tensors.push(info);
        }

        let data_start = r
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| invalid("data section offset overflows".into()))?;
        let file = GgufFile {
            path: path.to_path_buf(),
            version,
            alignment,
            metadata,
            tensors,
            data_start,
            bytes,
        };
        if !file.tensors.is_empty() && data_start > file.bytes.len() {
            return Err(invalid(format!(
                "truncated: the data section starts at byte {data_start} but the file has {} bytes",
                file.bytes.len()
            )));
        }
        for t in &file.tensors {
            file.check_range(t)?;
        }
        Ok(file)
    }

    /// Where the tensor's bytes lie in the file: its start, and its length when the type is
    /// supported (unsupported types cannot be sized).
    fn data_range(&self, t: &GgufTensorInfo) -> Result<(usize, Option<usize>)> {
        let invalid = |reason: String| Error::invalid_file(&self.path, reason);
        let start = usize::try_from(t.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start))
            .ok_or_else(|| invalid(format!("tensor `{}` offset overflows", t.name)))?;
        let Some(dtype) = t.dtype() else {
            return Ok((start, None));
        };
        // Every supported type takes at least half a byte per value, so this bound keeps the
        // size arithmetic below far from overflow. The row width is bounded on its own: with an
        // empty dimension the element count is 0 whatever the width.
        let n = t.n_elements();
        let cols = t.shape.last().copied().unwrap_or(1);
        if n / 2 > self.bytes.len() || cols / 2 > self.bytes.len() {
            return Err(invalid(format!(
                "tensor `{}` has {n} values in rows of {cols}, more than the file could hold",
                t.name
            )));
        }
        let rows = n.checked_div(cols).unwrap_or(0);
        let len = dtype
            .row_bytes(cols)
            .and_then(|rb| rb.checked_mul(rows))
            .ok_or_else(|| {
                invalid(format!(
                    "tensor `{}` of type {dtype} has rows of {cols} values, not a whole number \
                     of {}-value blocks",
                    t.name,
                    dtype.block_len()
                ))
            })?;
        Ok((start, Some(len)))
    }

    fn check_range(&self, t: &GgufTensorInfo) -> Result<()> {
        let file_len = self.bytes.len();
        let (start, len) = self.data_range(t)?;
        let len = len.unwrap_or(0);
        match start.checked_add(len) {
            Some(end) if end <= file_len => Ok(()),
            _ => Err(Error::invalid_file(
                &self.path,
                format!(
                    "tensor `{}` data (bytes {start}..{}) runs past the end of the file \
                     ({file_len} bytes); the file is truncated or the offset is corrupt",
                    t.name,
                    start.saturating_add(len)
                ),
            )),
        }
    }

    /// The path given at parse time.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and of every tensor offset, in bytes.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The tensor info named `name`.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's dtype, shape and bytes. Fails with [`Error::Unsupported`] naming the tensor
    /// and its ggml type when LeanStream cannot read that type.
    pub fn tensor_ref(&self, t: &GgufTensorInfo) -> Result<TensorRef> {
        let unsupported = || {
            Error::unsupported(
                &self.path,
                format!(
                    "tensor {} has type {} ({}), which is not supported; supported: {SUPPORTED_NAMES}",
                    t.name,
                    value::ggml_type_name(t.ggml_type),
                    t.ggml_type
                ),
            )
        };
        let dtype = t.dtype().ok_or_else(unsupported)?;
        let (start, len) = self.data_range(t)?;
        let len = len.ok_or_else(unsupported)?;
        let data = self.bytes.slice(start, len).ok_or_else(|| {
            Error::invalid_file(&self.path, format!("tensor `{}` runs past the end", t.name))
        })?;
        Ok(TensorRef {
            dtype,
            shape: t.shape.clone(),
            data,
        })
    }

    /// The raw value of `key`.
    pub fn value(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        f: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| {
                Error::invalid_file(
                    &self.path,
                    format!(
                        "metadata `{key}` is {} {}, expected {expected}",
                        v.type_name(),
                        short(v)
                    ),
                )
            }),
        }
    }

    /// `key` as a string; an error if present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", Value::as_str)
    }

    /// `key` as a non-negative integer of any width; an error if present with another type.
    pub fn get_uint(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    /// `key` as a float (f32 or f64); an error if present with another type.
    pub fn get_float(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a float", Value::as_f64)
    }

    /// `key` as a bool; an error if present with another type.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// `key` as an array of strings; an error if present with another type.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        self.typed(key, "an array of strings", |v| match v {
            Value::Array(Array::String(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// `key` as an array of i32; an error if present with another type.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<&[i32]>> {
        self.typed(key, "an array of i32", |v| match v {
            Value::Array(Array::I32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// `key` as an array of f32; an error if present with another type.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<&[f32]>> {
        self.typed(key, "an array of f32", |v| match v {
            Value::Array(Array::F32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// `key` as a non-negative integer that must be present.
    pub fn require_uint(&self, key: &str) -> Result<u64> {
        self.get_uint(key)?.ok_or_else(|| self.missing(key))
    }

    /// `key` as a string that must be present.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    fn missing(&self, key: &str) -> Error {
        Error::invalid_file(&self.path, format!("metadata key `{key}` is missing"))
    }
}

/// A value shortened for messages (arrays by length only).
fn short(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("({} elements)", a.len()),
        Value::String(s) if s.len() > 40 => format!("({} bytes)", s.len()),
        v => format!("{v:?}"),
    }
}

fn read_tensor_info(r: &mut Reader<'_>, alignment: usize) -> Result<GgufTensorInfo, String> {
    let name = r.string("tensor name")?;
    let ctx = |e: String| format!("`{name}`: {e}");
    let n_dims = r.u32("n_dims").map_err(ctx)? as usize;
    if !(1..=MAX_DIMS).contains(&n_dims) {
        return Err(ctx(format!("n_dims {n_dims} is outside 1..={MAX_DIMS}")));
    }
    let mut shape = Vec::with_capacity(n_dims);
    let mut n_elements: usize = 1;
    for d in 0..n_dims {
        let ne = r.len("dimension").map_err(ctx)?;
        if ne > i64::MAX as usize {
            return Err(ctx(format!("dimension {d} is {ne}, larger than i64::MAX")));
        }
        n_elements = n_elements
            .checked_mul(ne)
            .ok_or_else(|| ctx("element count overflows".into()))?;
        shape.push(ne);
    }
    shape.reverse();
    let ggml_type = r.u32("type").map_err(ctx)?;
    let offset = r.u64("offset").map_err(ctx)?;
    if offset % alignment as u64 != 0 {
        return Err(ctx(format!(
            "data offset {offset} is not a multiple of the alignment {alignment}"
        )));
    }
    Ok(GgufTensorInfo {
        name,
        ggml_type,
        shape,
        offset,
    })
}
