//! GGUF metadata values. Arrays keep their elements in typed vectors (strings packed into one
//! buffer) so that a 129k-entry vocabulary costs a few allocations, not one per element.

use std::fmt;

/// GGUF metadata value type ids, as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with GGUF id `id`, if defined.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Lower-case name used in messages (`u32`, `string`, ...).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Smallest number of bytes one value of this type occupies in a file (used to reject
    /// element counts that the remaining bytes could not hold before allocating anything).
    pub(crate) fn min_encoded_len(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,    // u64 length
            Array => 4 + 8, // element type + count
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
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
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// An array value: all elements share one type; arrays of arrays may mix inner types.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(StringArray),
    Array(Vec<Array>),
}

/// Why an array did not convert to the requested element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvertError {
    /// The element type cannot convert at all (e.g. strings to u32).
    WrongType,
    /// Element `index` is out of range for the target type (e.g. a negative i32).
    OutOfRange { index: usize },
}

/// Strings packed into one buffer: `ends[i]` is the end of string `i` in `data`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StringArray {
    data: String,
    ends: Vec<usize>,
}

impl StringArray {
    pub fn new() -> Self {
        Self::default()
    }

    /// Empty array with room for `n` strings totalling `bytes` bytes.
    pub fn with_capacity(n: usize, bytes: usize) -> Self {
        StringArray {
            data: String::with_capacity(bytes),
            ends: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, s: &str) {
        self.data.push_str(s);
        self.ends.push(self.data.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.data[start..end])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.ends.len()).map(move |i| {
            let start = if i == 0 { 0 } else { self.ends[i - 1] };
            &self.data[start..self.ends[i]]
        })
    }

    /// Total bytes of all strings.
    pub fn total_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_owned).collect()
    }
}

impl fmt::Debug for StringArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for StringArray {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut a = StringArray::new();
        for s in iter {
            a.push(s.as_ref());
        }
        a
    }
}

impl Array {
    /// Type of the elements.
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F32(_) => ValueType::F32,
            Array::F64(_) => ValueType::F64,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a `Value` (copies; use the typed vectors for bulk access).
    pub fn get(&self, i: usize) -> Option<Value> {
        Some(match self {
            Array::U8(v) => Value::U8(*v.get(i)?),
            Array::I8(v) => Value::I8(*v.get(i)?),
            Array::U16(v) => Value::U16(*v.get(i)?),
            Array::I16(v) => Value::I16(*v.get(i)?),
            Array::U32(v) => Value::U32(*v.get(i)?),
            Array::I32(v) => Value::I32(*v.get(i)?),
            Array::U64(v) => Value::U64(*v.get(i)?),
            Array::I64(v) => Value::I64(*v.get(i)?),
            Array::F32(v) => Value::F32(*v.get(i)?),
            Array::F64(v) => Value::F64(*v.get(i)?),
            Array::Bool(v) => Value::Bool(*v.get(i)?),
            Array::String(v) => Value::String(v.get(i)?.to_owned()),
            Array::Array(v) => Value::Array(v.get(i)?.clone()),
        })
    }

    /// Type description for messages, e.g. `array of u32`, `array of array`.
    pub fn type_name(&self) -> String {
        format!("array of {}", self.elem_type())
    }

    /// Elements as f32 when the element type converts as [`Value::as_f32`] allows (f32, f64,
    /// u32, i32 and the smaller integers); `None` for other element types.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        Some(match self {
            Array::F32(v) => v.clone(),
            Array::F64(v) => v.iter().map(|&x| x as f32).collect(),
            Array::U32(v) => v.iter().map(|&x| x as f32).collect(),
            Array::I32(v) => v.iter().map(|&x| x as f32).collect(),
            Array::U16(v) => v.iter().map(|&x| x as f32).collect(),
            Array::I16(v) => v.iter().map(|&x| x as f32).collect(),
            Array::U8(v) => v.iter().map(|&x| x as f32).collect(),
            Array::I8(v) => v.iter().map(|&x| x as f32).collect(),
            _ => return None,
        })
    }

    /// Elements as u32 when the elements are integers that fit (e.g. non-negative i32).
    pub fn to_u32_vec(&self) -> Result<Vec<u32>, ConvertError> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<u32>) -> Result<Vec<u32>, ConvertError> {
            v.iter()
                .enumerate()
                .map(|(index, &x)| f(x).ok_or(ConvertError::OutOfRange { index }))
                .collect()
        }
        match self {
            Array::U32(v) => Ok(v.clone()),
            Array::I32(v) => conv(v, |x| u32::try_from(x).ok()),
            Array::U8(v) => conv(v, |x| Some(x.into())),
            Array::U16(v) => conv(v, |x| Some(x.into())),
            Array::I8(v) => conv(v, |x| u32::try_from(x).ok()),
            Array::I16(v) => conv(v, |x| u32::try_from(x).ok()),
            Array::U64(v) => conv(v, |x| u32::try_from(x).ok()),
            Array::I64(v) => conv(v, |x| u32::try_from(x).ok()),
            _ => Err(ConvertError::WrongType),
        }
    }

    /// The strings, if this is a string array.
    pub fn as_strings(&self) -> Option<&StringArray> {
        match self {
            Array::String(s) => Some(s),
            _ => None,
        }
    }
}

impl Value {
    /// Type of the value (for arrays: `Array`; see [`Value::type_name`]).
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// Type description for messages: `u32`, `string`, `array of f32`, ...
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => a.type_name(),
            v => v.value_type().name().to_owned(),
        }
    }

    /// Any integer value, as i128 (lossless for every GGUF integer type).
    fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(x) => x.into(),
            Value::I8(x) => x.into(),
            Value::U16(x) => x.into(),
            Value::I16(x) => x.into(),
            Value::U32(x) => x.into(),
            Value::I32(x) => x.into(),
            Value::U64(x) => x.into(),
            Value::I64(x) => x.into(),
            _ => return None,
        })
    }

    /// Any integer type whose value fits in u32 (so a non-negative i32 or a small u64 too).
    pub fn as_u32(&self) -> Option<u32> {
        self.as_int().and_then(|x| u32::try_from(x).ok())
    }

    /// Any integer type whose value fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|x| u64::try_from(x).ok())
    }

    /// Any integer type whose value fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_int().and_then(|x| i64::try_from(x).ok())
    }

    /// f32, f64 (rounded to f32), u32, i32 or a smaller integer: GGUF writers store float
    /// hyper-parameters in any of these (model.md §2.2).
    pub fn as_f32(&self) -> Option<f32> {
        Some(match *self {
            Value::F32(x) => x,
            Value::F64(x) => x as f32,
            Value::U32(x) => x as f32,
            Value::I32(x) => x as f32,
            Value::U16(x) => x.into(),
            Value::I16(x) => x.into(),
            Value::U8(x) => x.into(),
            Value::I8(x) => x.into(),
            _ => return None,
        })
    }

    /// Like [`Value::as_f32`] but keeps f64 precision.
    pub fn as_f64(&self) -> Option<f64> {
        Some(match *self {
            Value::F64(x) => x,
            Value::F32(x) => x.into(),
            Value::U32(x) => x.into(),
            Value::I32(x) => x.into(),
            Value::U16(x) => x.into(),
            Value::I16(x) => x.into(),
            Value::U8(x) => x.into(),
            Value::I8(x) => x.into(),
            _ => return None,
        })
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Short human-readable rendering (arrays show their length and first elements), for `inspect`.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(x) => write!(f, "{x}"),
            Value::I8(x) => write!(f, "{x}"),
            Value::U16(x) => write!(f, "{x}"),
            Value::I16(x) => write!(f, "{x}"),
            Value::U32(x) => write!(f, "{x}"),
            Value::I32(x) => write!(f, "{x}"),
            Value::U64(x) => write!(f, "{x}"),
            Value::I64(x) => write!(f, "{x}"),
            Value::F32(x) => write!(f, "{x}"),
            Value::F64(x) => write!(f, "{x}"),
            Value::Bool(x) => write!(f, "{x}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) => {
                const SHOW: usize = 8;
                write!(f, "[{}; {}]", a.type_name(), a.len())?;
                if !a.is_empty() {
                    f.write_str(" [")?;
                    for i in 0..a.len().min(SHOW) {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        match a {
                            Array::String(s) => write!(f, "{:?}", s.get(i).unwrap_or_default())?,
                            Array::Array(v) => write!(f, "[{}; {}]", v[i].type_name(), v[i].len())?,
                            _ => match a.get(i) {
                                Some(v) => write!(f, "{v}")?,
                                None => break,
                            },
                        }
                    }
                    if a.len() > SHOW {
                        f.write_str(", ...")?;
                    }
                    f.write_str("]")?;
                }
                Ok(())
            }
        }
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Value { fn from(x: $t) -> Value { Value::$v(x) } }
        impl From<Vec<$t>> for Value { fn from(x: Vec<$t>) -> Value { Value::Array(Array::$v(x)) } }
        impl From<Vec<$t>> for Array { fn from(x: Vec<$t>) -> Array { Array::$v(x) } }
        impl From<&[$t]> for Value { fn from(x: &[$t]) -> Value { Value::Array(Array::$v(x.to_vec())) } }
    )*};
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, bool => Bool);

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::String(s)
    }
}
impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::String(s.to_owned())
    }
}
impl From<Array> for Value {
    fn from(a: Array) -> Value {
        Value::Array(a)
    }
}
impl From<StringArray> for Value {
    fn from(a: StringArray) -> Value {
        Value::Array(Array::String(a))
    }
}
impl From<Vec<String>> for Value {
    fn from(v: Vec<String>) -> Value {
        Value::Array(Array::String(v.iter().collect()))
    }
}
impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::Array(Array::String(v.iter().collect()))
    }
}
impl From<&[String]> for Value {
    fn from(v: &[String]) -> Value {
        Value::Array(Array::String(v.iter().collect()))
    }
}
impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Value {
        Value::Array(Array::Array(v))
    }
}
