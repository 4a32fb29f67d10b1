//! The DRA CEL environment on the `cel` crate: the `device` variable and the Kubernetes `quantity()` and
//! `semver()` libraries, so policy selectors read exactly like DeviceClass selectors.
//!
//! Differences from the API server's cel-go environment, and how they are handled:
//! * cel-go type-checks at compile time; the `cel` crate is dynamic. Type errors (a non-bool result, an
//!   operator on the wrong types, an undeclared variable) are found by evaluating every selector on every
//!   GPU before a policy is accepted, and reported as [`SelectorError::Type`].
//! * An unknown attribute/capacity **domain** is an empty map (as in Kubernetes), so
//!   `"x" in device.attributes["other.example.com"]` is false; an unknown attribute is a runtime error.
//! * There is no cost limit: selectors run in the controller only, over a handful of GPUs per node.

pub mod quantity;
pub mod semver;

use std::{any::Any, collections::BTreeMap, sync::Arc};

use cel::{
    Context, Env, ExecutionError, Program, ResolveResult, Value,
    common::{
        traits::Indexer,
        types::{CelString, Type},
        value::{CowVal, StaticVal, Val},
    },
    extractors::This,
    objects::{Map, Opaque},
};
use k8s_openapi::api::resource::v1::Device;

pub use self::{quantity::Quantity, semver::Semver};

/// Why a selector cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// The expression does not parse.
    #[error("syntax error in {source_text:?}: {message}")]
    Syntax { source_text: String, message: String },
    /// The expression applies something to the wrong type, or does not return a bool.
    #[error("type error in {source_text:?}: {message}")]
    Type { source_text: String, message: String },
    /// The expression failed on a device, e.g. on a missing attribute.
    #[error("runtime error in {source_text:?}: {message}")]
    Runtime { source_text: String, message: String },
}

/// A compiled selector.
#[derive(Debug)]
pub struct Selector {
    source: String,
    program: Program,
}

impl Selector {
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// A device as CEL sees it: attributes and capacities grouped by domain, unqualified names placed in the
/// driver's domain (`parseQualifiedName(name, driver)` in Kubernetes).
#[derive(Clone, Debug, Default)]
pub struct DeviceView {
    driver: String,
    attributes: BTreeMap<String, BTreeMap<String, Value>>,
    capacity: BTreeMap<String, BTreeMap<String, Value>>,
    allow_multiple_allocations: bool,
}

fn split_qualified<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    name.rsplit_once('/').unwrap_or((driver, name))
}

impl DeviceView {
    /// The view of a published device.
    pub fn from_device(driver: &str, device: &Device) -> Self {
        let mut view = Self {
            driver: driver.to_string(),
            allow_multiple_allocations: device.allow_multiple_allocations.unwrap_or(false),
            ..Default::default()
        };
        for (name, attr) in device.attributes.iter().flatten() {
            let (domain, id) = split_qualified(name, driver);
            let value = if let Some(i) = attr.int {
                Value::Int(i)
            } else if let Some(b) = attr.bool {
                Value::Bool(b)
            } else if let Some(s) = &attr.string {
                Value::String(Arc::new(s.clone()))
            } else if let Some(v) = &attr.version {
                match Semver::parse(v) {
                    Ok(v) => Value::Opaque(Arc::new(v)),
                    // Never published by tessera (the validator rejects it); keep the text visible.
                    Err(_) => Value::String(Arc::new(v.clone())),
                }
            } else {
                continue;
            };
            view.attributes
                .entry(domain.to_string())
                .or_default()
                .insert(id.to_string(), value);
        }
        for (name, cap) in device.capacity.iter().flatten() {
            let (domain, id) = split_qualified(name, driver);
            if let Ok(q) = Quantity::parse(&cap.value.0) {
                view.capacity
                    .entry(domain.to_string())
                    .or_default()
                    .insert(id.to_string(), Value::Opaque(Arc::new(q)));
            }
        }
        view
    }
}

// === impl Opaque for Quantity / Semver ===

impl Opaque for Quantity {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Quantity"
    }
}

impl Opaque for Semver {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Semver"
    }
}

// === the `device` variable ===

static DEVICE_TYPE: Type = Type::new_unspecified_type("kubernetes.DRADevice");
static DOMAINS_TYPE: Type = Type::new_unspecified_type("kubernetes.DRADomains");

/// `device.attributes` / `device.capacity`: a map whose unknown keys are empty maps.
#[derive(Debug)]
struct Domains {
    domains: BTreeMap<String, Box<dyn Val>>,
    empty: Box<dyn Val>,
}

impl Domains {
    fn new(domains: &BTreeMap<String, BTreeMap<String, Value>>) -> Result<Self, ExecutionError> {
        let to_val = |m: &BTreeMap<String, Value>| -> Result<Box<dyn Val>, ExecutionError> {
            let map: std::collections::HashMap<String, Value> = m.clone().into_iter().collect();
            Box::<dyn Val>::try_from(Value::Map(Map::from(map)))
        };
        Ok(Self {
            domains: domains
                .iter()
                .map(|(k, v)| Ok((k.clone(), to_val(v)?)))
                .collect::<Result<_, ExecutionError>>()?,
            empty: to_val(&BTreeMap::new())?,
        })
    }
}

impl Domains {
    fn duplicate(&self) -> Self {
        Self {
            domains: self
                .domains
                .iter()
                .map(|(k, v)| (k.clone(), v.clone_as_boxed()))
                .collect(),
            empty: self.empty.clone_as_boxed(),
        }
    }
}

fn key_str(idx: &dyn Val) -> Result<&str, ExecutionError> {
    idx.downcast_ref::<CelString<'_>>()
        .map(|s| s.inner())
        .ok_or_else(|| ExecutionError::UnexpectedType {
            got: idx.get_type().name().to_owned(),
            want: "string".to_owned(),
        })
}

impl Indexer for Domains {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let key = key_str(idx)?;
        let v: &'b (dyn Val + 'v) = &**self.domains.get(key).unwrap_or(&self.empty);
        Ok(CowVal::Borrowed(v))
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Val for Domains {
    fn get_type(&self) -> &Type {
        &DOMAINS_TYPE
    }
    fn cel_type() -> &'static Type {
        &DOMAINS_TYPE
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(self.duplicate())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for Domains {}

/// The `device` variable.
#[derive(Debug)]
struct DeviceVal {
    driver: Box<dyn Val>,
    attributes: Domains,
    capacity: Domains,
    allow_multiple_allocations: Box<dyn Val>,
}

impl Indexer for DeviceVal {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let v: &'b (dyn Val + 'v) = match key_str(idx)? {
            "driver" => &*self.driver,
            "attributes" => &self.attributes,
            "capacity" => &self.capacity,
            "allowMultipleAllocations" => &*self.allow_multiple_allocations,
            other => return Err(ExecutionError::no_such_key(other)),
        };
        Ok(CowVal::Borrowed(v))
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Val for DeviceVal {
    fn get_type(&self) -> &Type {
        &DEVICE_TYPE
    }
    fn cel_type() -> &'static Type {
        &DEVICE_TYPE
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v>
    where
        Self: 'v,
    {
        Box::new(DeviceVal {
            driver: self.driver.clone_as_boxed(),
            attributes: self.attributes.duplicate(),
            capacity: self.capacity.duplicate(),
            allow_multiple_allocations: self.allow_multiple_allocations.clone_as_boxed(),
        })
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DeviceVal {}

// === the quantity and semver libraries ===

fn fail(function: &str, message: impl ToString) -> ExecutionError {
    ExecutionError::function_error(function, message)
}

fn as_quantity<'a>(function: &str, v: &'a Value) -> Result<&'a Quantity, ExecutionError> {
    match v {
        Value::Opaque(o) => o.downcast_ref::<Quantity>(),
        _ => None,
    }
    .ok_or_else(|| ExecutionError::UnexpectedType {
        got: format!("{v:?}"),
        want: format!("Quantity for {function}"),
    })
}

fn as_semver<'a>(function: &str, v: &'a Value) -> Result<&'a Semver, ExecutionError> {
    match v {
        Value::Opaque(o) => o.downcast_ref::<Semver>(),
        _ => None,
    }
    .ok_or_else(|| ExecutionError::UnexpectedType {
        got: format!("{v:?}"),
        want: format!("Semver for {function}"),
    })
}

/// Compares two quantities or two versions.
fn ordering(function: &str, a: &Value, b: &Value) -> Result<std::cmp::Ordering, ExecutionError> {
    if let (Ok(x), Ok(y)) = (as_quantity(function, a), as_quantity(function, b)) {
        return Ok(x.compare(y));
    }
    Ok(as_semver(function, a)?.compare(as_semver(function, b)?))
}

fn quantity_fn(s: Arc<String>) -> ResolveResult {
    Quantity::parse(&s)
        .map(|q| Value::Opaque(Arc::new(q)))
        .map_err(|e| fail("quantity", e))
}

fn is_quantity(s: Arc<String>) -> bool {
    Quantity::parse(&s).is_ok()
}

fn semver_fn(s: Arc<String>) -> ResolveResult {
    Semver::parse(&s)
        .map(|v| Value::Opaque(Arc::new(v)))
        .map_err(|e| fail("semver", e))
}

fn is_semver(s: Arc<String>) -> bool {
    Semver::parse(&s).is_ok()
}

fn compare_to(This(this): This<Value>, other: Value) -> ResolveResult {
    Ok(Value::Int(ordering("compareTo", &this, &other)? as i64))
}

fn is_greater_than(This(this): This<Value>, other: Value) -> ResolveResult {
    Ok(Value::Bool(ordering("isGreaterThan", &this, &other)?.is_gt()))
}

fn is_less_than(This(this): This<Value>, other: Value) -> ResolveResult {
    Ok(Value::Bool(ordering("isLessThan", &this, &other)?.is_lt()))
}

fn as_integer(This(this): This<Value>) -> ResolveResult {
    as_quantity("asInteger", &this)?
        .as_integer()
        .map(Value::Int)
        .ok_or_else(|| fail("asInteger", "quantity is not an integer or does not fit an int"))
}

fn is_integer(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Bool(as_quantity("isInteger", &this)?.is_integer()))
}

fn as_approximate_float(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Float(
        as_quantity("asApproximateFloat", &this)?.as_approximate_float(),
    ))
}

fn sign(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Int(as_quantity("sign", &this)?.sign()))
}

fn operand(function: &str, v: &Value) -> Result<Quantity, ExecutionError> {
    match v {
        Value::Int(i) => Ok(Quantity::from_int(*i)),
        v => as_quantity(function, v).copied(),
    }
}

fn add(This(this): This<Value>, other: Value) -> ResolveResult {
    let sum = as_quantity("add", &this)?.checked_add(&operand("add", &other)?);
    sum.map(|q| Value::Opaque(Arc::new(q)))
        .ok_or_else(|| fail("add", "overflow"))
}

fn sub(This(this): This<Value>, other: Value) -> ResolveResult {
    let diff = as_quantity("sub", &this)?.checked_sub(&operand("sub", &other)?);
    diff.map(|q| Value::Opaque(Arc::new(q)))
        .ok_or_else(|| fail("sub", "overflow"))
}

fn major(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Int(as_semver("major", &this)?.major as i64))
}

fn minor(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Int(as_semver("minor", &this)?.minor as i64))
}

fn patch(This(this): This<Value>) -> ResolveResult {
    Ok(Value::Int(as_semver("patch", &this)?.patch as i64))
}

/// Compiles and evaluates selectors.
pub struct CelEnv {
    /// Root context with the quantity/semver functions; each evaluation binds `device` in a child scope.
    root: Context<'static, 'static>,
}

impl Default for CelEnv {
    fn default() -> Self {
        Self::new()
    }
}

impl CelEnv {
    pub fn new() -> Self {
        let mut env = Env::stdlib();
        // Kubernetes' base environment has ext.Strings; the cel crate's strings extension is the same set.
        env.add_extension(cel::extensions::strings)
            .expect("the strings extension registers once");
        Self {
            root: Self::root_context(Arc::new(env)),
        }
    }

    /// Parses `source`.
    pub fn compile(&self, source: &str) -> Result<Selector, SelectorError> {
        self.env()
            .compile(source)
            .map(|program| Selector {
                source: source.to_string(),
                program,
            })
            .map_err(|e| SelectorError::Syntax {
                source_text: source.to_string(),
                message: e.to_string(),
            })
    }

    fn env(&self) -> &Env {
        match &self.root {
            Context::Root { env, .. } => env,
            Context::Child { .. } => unreachable!("the root context is a root"),
        }
    }

    fn root_context(env: Arc<Env>) -> Context<'static, 'static> {
        let mut ctx = Context::with_env(env);
        let names_in_use = "function names are not taken by the standard library";
        ctx.add_function("quantity", quantity_fn).expect(names_in_use);
        ctx.add_function("isQuantity", is_quantity).expect(names_in_use);
        ctx.add_function("semver", semver_fn).expect(names_in_use);
        ctx.add_function("isSemver", is_semver).expect(names_in_use);
        ctx.add_function("compareTo", compare_to).expect(names_in_use);
        ctx.add_function("isGreaterThan", is_greater_than)
            .expect(names_in_use);
        ctx.add_function("isLessThan", is_less_than).expect(names_in_use);
        ctx.add_function("asInteger", as_integer).expect(names_in_use);
        ctx.add_function("isInteger", is_integer).expect(names_in_use);
        ctx.add_function("asApproximateFloat", as_approximate_float)
            .expect(names_in_use);
        ctx.add_function("sign", sign).expect(names_in_use);
        ctx.add_function("add", add).expect(names_in_use);
        ctx.add_function("sub", sub).expect(names_in_use);
        ctx.add_function("major", major).expect(names_in_use);
        ctx.add_function("minor", minor).expect(names_in_use);
        ctx.add_function("patch", patch).expect(names_in_use);
        ctx
    }

    /// Evaluates `selector` on `device`; anything but a bool is an error, as in Kubernetes.
    pub fn matches(&self, selector: &Selector, device: &DeviceView) -> Result<bool, SelectorError> {
        let source_text = selector.source.clone();
        let runtime = |message: String| SelectorError::Runtime {
            source_text: source_text.clone(),
            message,
        };
        let mut ctx = self.root.new_inner_scope();
        let device_val = DeviceVal {
            driver: Box::new(CelString::from(device.driver.clone())),
            attributes: Domains::new(&device.attributes).map_err(|e| runtime(e.to_string()))?,
            capacity: Domains::new(&device.capacity).map_err(|e| runtime(e.to_string()))?,
            allow_multiple_allocations: Box::<dyn Val>::try_from(Value::Bool(
                device.allow_multiple_allocations,
            ))
            .map_err(|e| runtime(e.to_string()))?,
        };
        ctx.add_variable_as_val("device", Box::new(device_val));
        match selector.program.execute(&ctx) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(SelectorError::Type {
                source_text: selector.source.clone(),
                message: format!("selector must return a bool, returned {other:?}"),
            }),
            Err(e) => Err(classify(&selector.source, e)),
        }
    }
}

fn classify(source: &str, e: ExecutionError) -> SelectorError {
    let source_text = source.to_string();
    let message = e.to_string();
    match e {
        ExecutionError::NoSuchOverload(_)
        | ExecutionError::UnsupportedBinaryOperator(..)
        | ExecutionError::UnexpectedType { .. }
        | ExecutionError::ValuesNotComparable(..)
        | ExecutionError::UndeclaredReference(_)
        | ExecutionError::InvalidArgumentCount { .. }
        | ExecutionError::NotSupportedAsMethod { .. }
        | ExecutionError::UnsupportedTargetType { .. } => SelectorError::Type { source_text, message },
        _ => SelectorError::Runtime { source_text, message },
    }
}
