//! `mlp_offload._core`: the thin PyO3 layer over `mlp-offload-core`. Addresses and lengths cross the
//! boundary, never tensors; every call that can block releases the GIL.

use std::os::raw::c_int;
use std::path::PathBuf;
use std::time::Duration;

use mlp_offload_core::accelerator_update::{split as split_update, SplitInputs};
use mlp_offload_core::admission::Sharing;
use mlp_offload_core::blockstat::{BlockActivity, BlockCounters};
use mlp_offload_core::kernel::{
    update_at, witness, AdamBias, AdamHyper, BiasSqrt, ChunkAt, Cuts, Decay, DeepSpeedArith, Kind,
    MomentFma, Simd, StateKinds, StateLayout, TailFma,
};
use mlp_offload_core::model::{
    pages_choice as choose_pages, plan_split, PageRates, PathProfile, PathSample, UpdateWorkload,
    WeightTuner,
};
use mlp_offload_core::probe::{probe_across_nodes, probe_paths, ProbeOptions};
use mlp_offload_core::store::{ReadCheck, StripeSums};
use mlp_offload_core::{
    page_report, AlignedBuf, BufferPool, Completion, EngineChoice, Error, HostPtr, ObjectStore,
    Pages, PathLimits, PooledBuf, StoreConfig,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pythonize::{depythonize, pythonize};
use std::sync::Arc;

create_exception!(
    _core,
    CorruptObjectError,
    PyOSError,
    "A stored object is not what was written (checksum mismatch, truncated file, failed last write)."
);

/// The one place where core errors become Python exceptions: I/O and corruption as `OSError` (errno,
/// filename), configuration as `ValueError`.
fn to_py(e: Error) -> PyErr {
    let message = e.to_string();
    match &e {
        Error::Config { .. } => PyValueError::new_err(message),
        Error::Corrupt { path, .. } => {
            CorruptObjectError::new_err((libc::EIO, message, path.display().to_string()))
        }
        Error::Io { .. } | Error::NotFound { .. } | Error::InUse { .. } => {
            let errno = e.errno().unwrap_or(libc::EIO);
            let path = e.path().map(|p| p.display().to_string());
            PyOSError::new_err((errno, message, path))
        }
    }
}

/// A list of dicts as core values; a bad one is a `ValueError` naming `key[index]`.
fn from_dicts<T: serde::de::DeserializeOwned>(
    items: &[Bound<'_, PyAny>],
    key: &str,
) -> PyResult<Vec<T>> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            depythonize::<T>(item)
                .map_err(|e| to_py(Error::config(format!("{key}[{i}]"), e.to_string())))
        })
        .collect()
}

fn to_py_json<T: serde::Serialize>(py: Python<'_>, value: &T) -> PyResult<Py<PyAny>> {
    Ok(pythonize(py, value)
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?
        .unbind())
}

/// An operation in flight. `wait()` blocks (without the GIL) and raises its error; `done()` polls.
#[pyclass(module = "mlp_offload._core", frozen)]
struct IoHandle {
    completion: Completion,
}

#[pymethods]
impl IoHandle {
    /// Blocks until the operation is done; raises its error. With `timeout` (seconds), returns False
    /// if it is not done in time.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let completion = self.completion.clone();
        let outcome = match timeout {
            None => Some(py.detach(move || completion.wait())),
            Some(t) if t.is_finite() && t >= 0.0 => {
                py.detach(move || completion.wait_timeout(Duration::from_secs_f64(t)))
            }
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout: {t} is not a non-negative number"
                )))
            }
        };
        match outcome {
            None => Ok(false),
            Some(r) => r.map(|()| true).map_err(to_py),
        }
    }

    fn done(&self) -> bool {
        self.completion.is_done()
    }
}

enum HostMemory {
    Owned(AlignedBuf),
    Pooled(PooledBuf),
}

impl HostMemory {
    fn buf(&self) -> &AlignedBuf {
        match self {
            HostMemory::Owned(b) => b,
            HostMemory::Pooled(b) => b,
        }
    }
}

/// Page-aligned host memory owned by the runtime, exported through the buffer protocol so that
/// `torch.frombuffer` views it without a copy. The memory lives as long as any view of it.
#[pyclass(module = "mlp_offload._core", frozen)]
struct HostBuffer {
    memory: HostMemory,
}

#[pymethods]
impl HostBuffer {
    #[new]
    #[pyo3(signature = (nbytes, lock=false, pages="small"))]
    fn new(py: Python<'_>, nbytes: usize, lock: bool, pages: &str) -> PyResult<Self> {
        let pages = Pages::parse("pages", pages).map_err(to_py)?;
        let buf = py
            .detach(|| AlignedBuf::with_pages(nbytes, lock, pages))
            .map_err(to_py)?;
        Ok(HostBuffer {
            memory: HostMemory::Owned(buf),
        })
    }

    /// How the buffer's bytes are backed: `bytes`, `reserved_huge_bytes`, `transparent_huge_bytes`.
    #[getter]
    fn page_report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_json(py, &page_report([self.memory.buf()]))
    }

    #[getter]
    fn address(&self) -> usize {
        self.memory.buf().as_ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.memory.buf().len()
    }

    #[getter]
    fn locked(&self) -> bool {
        self.memory.buf().is_locked()
    }

    fn __len__(&self) -> usize {
        self.memory.buf().len()
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let buf = slf.get().memory.buf();
        // SAFETY: `view` is the caller's Py_buffer; the memory is owned by `slf`, which the view keeps a
        // reference to (FillInfo increfs `obj`), so it outlives every export. The memory is writable:
        // it is plain host memory that the runtime only reads or writes during I/O the caller started.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                buf.as_ptr() as *mut std::ffi::c_void,
                buf.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(PyErr::fetch(slf.py()))
        }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A fixed set of equally sized `HostBuffer`s; a buffer returns to the pool when its last view is gone.
#[pyclass(module = "mlp_offload._core", frozen)]
struct HostBufferPool {
    pool: BufferPool,
}

#[pymethods]
impl HostBufferPool {
    #[new]
    #[pyo3(signature = (count, buffer_size, lock=true, pages="small"))]
    fn new(
        py: Python<'_>,
        count: usize,
        buffer_size: usize,
        lock: bool,
        pages: &str,
    ) -> PyResult<Self> {
        let pages = Pages::parse("pages", pages).map_err(to_py)?;
        let pool = py
            .detach(|| BufferPool::with_pages(count, buffer_size, lock, pages))
            .map_err(to_py)?;
        Ok(HostBufferPool { pool })
    }

    /// The pages asked for: `"small"` or `"huge"`.
    #[getter]
    fn pages(&self) -> &'static str {
        self.pool.pages().name()
    }

    /// How the buffers' bytes are backed: `bytes`, `reserved_huge_bytes`, `transparent_huge_bytes`.
    #[getter]
    fn page_report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_json(py, &self.pool.page_report())
    }

    /// A free buffer, or None when every buffer is in use.
    fn acquire(&self) -> Option<HostBuffer> {
        self.pool.acquire().map(|b| HostBuffer {
            memory: HostMemory::Pooled(b),
        })
    }

    #[getter]
    fn buffer_size(&self) -> usize {
        self.pool.buffer_size()
    }

    #[getter]
    fn count(&self) -> usize {
        self.pool.count()
    }

    #[getter]
    fn available(&self) -> usize {
        self.pool.available()
    }

    #[getter]
    fn locked(&self) -> bool {
        self.pool.is_locked()
    }
}

fn moment_fma(key: &str, value: &str) -> PyResult<MomentFma> {
    match value {
        "gradient" => Ok(MomentFma::Gradient),
        "old" => Ok(MomentFma::Old),
        "separate" => Ok(MomentFma::Separate),
        other => Err(to_py(Error::config(
            key,
            format!("{other:?} is not \"gradient\", \"old\" or \"separate\""),
        ))),
    }
}

fn moment_name(how: MomentFma) -> &'static str {
    match how {
        MomentFma::Gradient => "gradient",
        MomentFma::Old => "old",
        MomentFma::Separate => "separate",
    }
}

fn arith_dict(py: Python<'_>, arith: &DeepSpeedArith) -> PyResult<Py<PyAny>> {
    let dict = pyo3::types::PyDict::new(py);
    dict.set_item("vector_width", arith.vector_width)?;
    dict.set_item("momentum", moment_name(arith.tail.momentum))?;
    dict.set_item("variance", moment_name(arith.tail.variance))?;
    dict.set_item("others", arith.tail.others)?;
    dict.set_item(
        "bias_sqrt",
        match arith.bias_sqrt {
            BiasSqrt::Float => "float",
            BiasSqrt::Double => "double",
        },
    )?;
    Ok(dict.into_any().unbind())
}

/// torch's name of a dtype (`Kind::parse`'s).
fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::F32 => "float32",
        Kind::Bf16 => "bfloat16",
        Kind::F16 => "float16",
    }
}

/// How a chunk keeps a state (`StateLayout`): parsed and checked once, where it is made.
#[pyclass(module = "mlp_offload._core", name = "StateLayout", frozen)]
struct PyStateLayout {
    layout: StateLayout,
}

#[pymethods]
impl PyStateLayout {
    #[new]
    #[pyo3(signature = (master, moments, *, stored_master=None, stored_moments=None,
                        master_in_params=false))]
    fn new(
        master: &str,
        moments: &str,
        stored_master: Option<&str>,
        stored_moments: Option<&str>,
        master_in_params: bool,
    ) -> PyResult<Self> {
        let kinds = StateKinds {
            master: Kind::parse("master", master).map_err(to_py)?,
            moments: Kind::parse("moments", moments).map_err(to_py)?,
        };
        let stored = StateKinds {
            master: match stored_master {
                Some(name) => Kind::parse("stored_master", name).map_err(to_py)?,
                None => kinds.master,
            },
            moments: match stored_moments {
                Some(name) => Kind::parse("stored_moments", name).map_err(to_py)?,
                None => kinds.moments,
            },
        };
        let layout = StateLayout::new(kinds, stored, master_in_params).map_err(to_py)?;
        Ok(PyStateLayout { layout })
    }

    #[getter]
    fn master(&self) -> &'static str {
        dtype_name(self.layout.kinds.master)
    }

    #[getter]
    fn moments(&self) -> &'static str {
        dtype_name(self.layout.kinds.moments)
    }

    #[getter]
    fn stored_master(&self) -> &'static str {
        dtype_name(self.layout.stored.master)
    }

    #[getter]
    fn stored_moments(&self) -> &'static str {
        dtype_name(self.layout.stored.moments)
    }

    #[getter]
    fn master_in_params(&self) -> bool {
        self.layout.master_in_params
    }

    /// Where a chunk of `count` elements keeps the state: each array's first byte (params, exp_avg,
    /// exp_avg_sq; the wider arrays first; with `master_in_params` the params' is past the moments),
    /// and the chunk's bytes.
    fn offsets(&self, count: usize) -> (Vec<usize>, usize) {
        let (offsets, total) = self.layout.offsets(count);
        (offsets.to_vec(), total)
    }

    fn __repr__(&self) -> String {
        format!(
            "StateLayout('{}', '{}', stored_master='{}', stored_moments='{}', master_in_params={})",
            self.master(),
            self.moments(),
            self.stored_master(),
            self.stored_moments(),
            if self.layout.master_in_params {
                "True"
            } else {
                "False"
            }
        )
    }
}

/// Adam's hyperparameters of one param group (`AdamHyper`).
#[pyclass(module = "mlp_offload._core", name = "AdamGroup", frozen)]
struct PyAdamGroup {
    hyper: AdamHyper,
}

#[pymethods]
impl PyAdamGroup {
    #[new]
    fn new(
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        bias_correction: bool,
        adamw: bool,
    ) -> Self {
        PyAdamGroup {
            hyper: AdamHyper {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                bias_correction,
                adamw,
            },
        }
    }

    #[getter]
    fn lr(&self) -> f32 {
        self.hyper.lr
    }

    #[getter]
    fn beta1(&self) -> f32 {
        self.hyper.beta1
    }

    #[getter]
    fn beta2(&self) -> f32 {
        self.hyper.beta2
    }

    #[getter]
    fn eps(&self) -> f32 {
        self.hyper.eps
    }

    #[getter]
    fn weight_decay(&self) -> f32 {
        self.hyper.weight_decay
    }

    #[getter]
    fn bias_correction(&self) -> bool {
        self.hyper.bias_correction
    }

    #[getter]
    fn adamw(&self) -> bool {
        self.hyper.adamw
    }

    fn __repr__(&self) -> String {
        let h = &self.hyper;
        let py_bool = |b: bool| if b { "True" } else { "False" };
        format!(
            "AdamGroup(lr={:?}, beta1={:?}, beta2={:?}, eps={:?}, weight_decay={:?}, \
             bias_correction={}, adamw={})",
            h.lr,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            py_bool(h.bias_correction),
            py_bool(h.adamw)
        )
    }
}

/// One chunk's addresses and element types (`ChunkAt`): parsed and checked once, where it is made.
#[pyclass(module = "mlp_offload._core", name = "ChunkArrays", frozen)]
struct PyChunkArrays {
    at: ChunkAt,
}

#[pymethods]
impl PyChunkArrays {
    #[new]
    #[pyo3(signature = (state, grad, grad_dtype, count, *, params=None, params_dtype=None,
                        keep_state=None, keep_params=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        state: usize,
        grad: usize,
        grad_dtype: &str,
        count: usize,
        params: Option<usize>,
        params_dtype: Option<&str>,
        keep_state: Option<usize>,
        keep_params: bool,
    ) -> PyResult<Self> {
        let grad_kind = Kind::parse("grad_dtype", grad_dtype).map_err(to_py)?;
        let params = match (params, params_dtype) {
            (Some(at), Some(name)) => Some((at, Kind::parse("params_dtype", name).map_err(to_py)?)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(to_py(Error::config(
                    "params_dtype",
                    "none given for the params given",
                )))
            }
            (None, Some(_)) => {
                return Err(to_py(Error::config("params_dtype", "given without params")))
            }
        };
        if keep_params && params.is_none() {
            return Err(to_py(Error::config(
                "keep_params",
                "keeps the parameters before the pass, and no params were given",
            )));
        }
        Ok(PyChunkArrays {
            at: ChunkAt {
                state,
                grad: (grad, grad_kind),
                params,
                keep_state,
                keep_params,
                count,
            },
        })
    }

    #[getter]
    fn state(&self) -> usize {
        self.at.state
    }

    #[getter]
    fn grad(&self) -> usize {
        self.at.grad.0
    }

    #[getter]
    fn grad_dtype(&self) -> &'static str {
        dtype_name(self.at.grad.1)
    }

    #[getter]
    fn count(&self) -> usize {
        self.at.count
    }

    #[getter]
    fn params(&self) -> Option<usize> {
        self.at.params.map(|(at, _)| at)
    }

    #[getter]
    fn params_dtype(&self) -> Option<&'static str> {
        self.at.params.map(|(_, kind)| dtype_name(kind))
    }

    #[getter]
    fn keep_state(&self) -> Option<usize> {
        self.at.keep_state
    }

    #[getter]
    fn keep_params(&self) -> bool {
        self.at.keep_params
    }
}

/// The state's stripe checksums as read and as written, where asked for; the parameters kept as they
/// were before the pass (first element, bytes), where asked for; and with the master weights in the
/// parameters, the parameters' checksums as read and as written, where the state's were asked for.
type ChunkSumsPy = (
    Option<Vec<u32>>,
    Option<Vec<u32>>,
    Option<Vec<(usize, Py<PyBytes>)>>,
    (Option<u32>, Option<u32>),
);

/// DeepSpeed's CPU Adam update of one chunk in one pass, with the gradient's widening and unscaling and
/// the half-precision copy (see `mlp_offload.engine.fused_update`), keeping DeepSpeed's per-optimizer bias state.
#[pyclass(module = "mlp_offload._core", frozen)]
struct AdamKernel {
    bias: std::sync::Mutex<AdamBias>,
    arith: DeepSpeedArith,
    simd: Simd,
}

#[pymethods]
impl AdamKernel {
    #[new]
    #[pyo3(signature = (beta1, beta2, *, vector_width=16, momentum="gradient", variance="gradient",
                        others=true, bias_sqrt="float", simd="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        beta1: f32,
        beta2: f32,
        vector_width: usize,
        momentum: &str,
        variance: &str,
        others: bool,
        bias_sqrt: &str,
        simd: &str,
    ) -> PyResult<Self> {
        let bias_sqrt = match bias_sqrt {
            "float" => BiasSqrt::Float,
            "double" => BiasSqrt::Double,
            other => {
                return Err(to_py(Error::config(
                    "bias_sqrt",
                    format!("{other:?} is not \"float\" or \"double\""),
                )))
            }
        };
        if vector_width == 0 {
            return Err(to_py(Error::config("vector_width", "must be at least 1")));
        }
        Ok(AdamKernel {
            bias: std::sync::Mutex::new(AdamBias::new(beta1, beta2, bias_sqrt)),
            arith: DeepSpeedArith {
                vector_width,
                tail: TailFma {
                    momentum: moment_fma("momentum", momentum)?,
                    variance: moment_fma("variance", variance)?,
                    others,
                },
                bias_sqrt,
            },
            simd: Simd::parse("simd", simd).map_err(to_py)?,
        })
    }

    /// Every arithmetic a DeepSpeed build may have, as keyword arguments of the constructor, the likeliest
    /// first.
    #[staticmethod]
    fn candidates(py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        DeepSpeedArith::candidates()
            .iter()
            .map(|a| arith_dict(py, a))
            .collect()
    }

    /// The first Adam step (from 3) at which a call jumping there with this `beta2` computes another bias
    /// correction with a float square root than with a double one, or None: a check call there tells
    /// DeepSpeed's build apart.
    #[staticmethod]
    fn sqrt_witness(beta2: f32) -> Option<u64> {
        AdamBias::sqrt_witness(beta2)
    }

    /// One element's inputs `(param, exp_avg, exp_avg_sq, grad_bits)` whose outputs with this kernel's
    /// arithmetic differ from `other`'s, for a call at Adam step `step` with `group`'s hyperparameters
    /// after this kernel's calls so far (its bias state is not advanced) with the state in
    /// `master_dtype` and `moments_dtype`; None if none of `witness.TRIES` random elements from `seed`
    /// does. `vector`, `other_vector`: each side's arithmetic is DeepSpeed's vector code's (else its
    /// scalar loop's). The values are exact in their dtypes, the gradient's bits of the master weights'
    /// dtype where that is half precision, else fp32's. Runs without the GIL.
    #[pyo3(signature = (other, group, *, step, grad_scale, master_dtype, moments_dtype, seed,
                        vector=false, other_vector=false))]
    #[allow(clippy::too_many_arguments)]
    fn witness(
        &self,
        py: Python<'_>,
        other: &AdamKernel,
        group: &PyAdamGroup,
        step: u64,
        grad_scale: f32,
        master_dtype: &str,
        moments_dtype: &str,
        seed: u64,
        vector: bool,
        other_vector: bool,
    ) -> PyResult<Option<(f32, f32, f32, u32)>> {
        let kinds = StateKinds::parse(master_dtype, moments_dtype).map_err(to_py)?;
        // The gradient in the master weights' dtype, as the witness's is.
        kinds.check(kinds.master, None).map_err(to_py)?;
        let k = self
            .bias
            .lock()
            .expect("bias lock")
            .clone()
            .constants(step, &group.hyper);
        let how = |vector: bool, kernel: &AdamKernel| {
            if vector {
                TailFma::VECTOR
            } else {
                kernel.arith.tail
            }
        };
        let (a, b) = (how(vector, self), how(other_vector, other));
        let found = py.detach(|| witness(a, b, &k, grad_scale, kinds, seed));
        Ok(found.map(|w| (w.param, w.exp_avg, w.exp_avg_sq, w.grad_bits)))
    }

    /// The per-element constants of a call at Adam step `step` with `group`'s hyperparameters, the bias
    /// state advanced as `update` advances it (one state for every chunk, wherever it is updated, as
    /// DeepSpeed's one `Adam_Optimizer` serves every subgroup): what the accelerator's pass
    /// (`mlp_offload.engine.accelerator_adam`) takes. `decay` is `"none"`, `"l2"` or `"adamw"`, and
    /// `decay_value` Adam's decay or AdamW's `-lr x decay`.
    fn constants(&self, py: Python<'_>, group: &PyAdamGroup, step: u64) -> PyResult<Py<PyAny>> {
        let k = self
            .bias
            .lock()
            .expect("bias lock")
            .constants(step, &group.hyper);
        let (decay, decay_value) = match k.decay {
            Decay::None => ("none", 0.0),
            Decay::L2(d) => ("l2", d),
            Decay::AdamW(w) => ("adamw", w),
        };
        let dict = pyo3::types::PyDict::new(py);
        for (name, value) in [
            ("beta1", k.beta1),
            ("beta2", k.beta2),
            ("one_minus_beta1", k.one_minus_beta1),
            ("one_minus_beta2", k.one_minus_beta2),
            ("bias_correction2", k.bias_correction2),
            ("eps", k.eps),
            ("step_size", k.step_size),
            ("decay_value", decay_value),
        ] {
            dict.set_item(name, value)?;
        }
        dict.set_item("decay", decay)?;
        Ok(dict.into_any().unbind())
    }

    /// The vector width of the DeepSpeed build it matches for a state in these dtypes (1: every element
    /// takes the scalar loop; an AVX2 build's for bf16).
    fn vector_width_for(&self, master_dtype: &str, moments_dtype: &str) -> PyResult<usize> {
        let kinds = StateKinds::parse(master_dtype, moments_dtype).map_err(to_py)?;
        Ok(self.arith.vector_width_for(kinds))
    }

    /// The SIMD instructions the pass uses: `"avx512-clmul"`, `"avx512"`, `"avx2-clmul"`, `"avx2"` or
    /// `"scalar"`.
    #[getter]
    fn simd(&self) -> &'static str {
        self.simd.name()
    }

    /// The DeepSpeed arithmetic it matches, as `candidates()` gives it.
    #[getter]
    fn arith(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        arith_dict(py, &self.arith)
    }

    /// One chunk, in place: `arrays` its addresses and element types, its state laid out as `layout`
    /// says (`StateLayout.offsets`), updated with `group`'s hyperparameters; the bias correction
    /// advances as DeepSpeed's would for a call at Adam step `step`. With `arrays.keep_params`, the
    /// parameters before the pass that were not the old weights narrowed come back, a block at a
    /// time, as (first element, bytes). With `arrays.keep_state` (address of as many bytes as the
    /// state's), the state before the pass is copied there in the pass. Each value of the state is
    /// rounded to `layout`'s dtypes as DeepSpeed's CPU Adam stores it (the gradient and the parameters
    /// in the master weights' dtype where that is half precision). With `layout.master_in_params`,
    /// `arrays.params` are the master weights themselves, the state and the kept state the moments
    /// alone, `keep_params` keeps every parameter, and the parameters' checksums come back apart. Runs
    /// without the GIL.
    #[pyo3(signature = (arrays, layout, group, *, step, grad_scale, threads, read_cuts=None,
                        write_cuts=None))]
    #[allow(clippy::too_many_arguments)]
    fn update(
        &self,
        py: Python<'_>,
        arrays: &PyChunkArrays,
        layout: &PyStateLayout,
        group: &PyAdamGroup,
        step: u64,
        grad_scale: f32,
        threads: usize,
        read_cuts: Option<Vec<u64>>,
        write_cuts: Option<Vec<u64>>,
    ) -> PyResult<ChunkSumsPy> {
        let k = self
            .bias
            .lock()
            .expect("bias lock")
            .constants(step, &group.hyper);
        let (arith, simd) = (self.arith, self.simd);
        let (at, layout) = (arrays.at, layout.layout);
        let cuts = Cuts {
            read: read_cuts.as_deref(),
            write: write_cuts.as_deref(),
        };
        let sums = py
            .detach(|| {
                // SAFETY: `mlp_offload.engine.fused_update.FusedAdam.update` makes `arrays` of the data
                // pointers of contiguous CPU tensors of these lengths and dtypes, which it holds for the
                // whole call; the state buffer, the gradient, the half-precision partition and the kept
                // state's buffer are distinct tensors.
                unsafe { update_at(at, layout, grad_scale, &k, &arith, simd, threads, cuts) }
            })
            .map_err(to_py)?;
        let kept = sums.kept_params.map(|kept| {
            kept.into_iter()
                .map(|k| (k.first, PyBytes::new(py, &k.bytes).unbind()))
                .collect()
        });
        let [params_read, params_write] = sums.params;
        Ok((sums.read, sums.write, kept, (params_read, params_write)))
    }
}

/// What a read without the store's verification read: each stripe's start (`starts`), for the caller's
/// sums, and what `ObjectStore.verify` compares them with.
#[pyclass(module = "mlp_offload._core", name = "ReadCheck", frozen)]
struct PyReadCheck {
    check: ReadCheck,
}

#[pymethods]
impl PyReadCheck {
    /// Each stripe's first byte in the object, ascending from 0.
    #[getter]
    fn starts(&self) -> Vec<u64> {
        self.check.starts().to_vec()
    }

    /// Whether the object has checksums to verify.
    #[getter]
    fn has_sums(&self) -> bool {
        self.check.has_sums()
    }
}

/// The virtual-tier object store (see `mlp_offload.ObjectStore` for the tensor-level API).
#[pyclass(module = "mlp_offload._core", name = "ObjectStore", frozen)]
struct PyObjectStore {
    store: std::sync::RwLock<Option<Arc<ObjectStore>>>,
}

impl PyObjectStore {
    fn get(&self) -> PyResult<Arc<ObjectStore>> {
        self.store
            .read()
            .expect("store lock")
            .clone()
            .ok_or_else(|| PyValueError::new_err("the object store is closed"))
    }
}

#[pymethods]
impl PyObjectStore {
    #[new]
    #[pyo3(signature = (paths, *, rank=0, engine="auto", chunk_size=None, max_inflight=None, weights=None,
                        checksum=true, shadow_slots=true, device_inflight=None, device_sharing=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        rank: u32,
        engine: &str,
        chunk_size: Option<usize>,
        max_inflight: Option<usize>,
        weights: Option<Vec<f64>>,
        checksum: bool,
        shadow_slots: bool,
        device_inflight: Option<Vec<Option<u32>>>,
        device_sharing: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let defaults = PathLimits::default();
        let n_paths = paths.len();
        let limits = PathLimits {
            chunk_size: chunk_size.unwrap_or(defaults.chunk_size),
            max_inflight: max_inflight.unwrap_or(defaults.max_inflight),
        };
        let mut config = StoreConfig::new(paths)
            .with_rank(rank)
            .with_engine(engine.parse::<EngineChoice>().map_err(to_py)?)
            .with_limits(limits)
            .with_checksum(checksum)
            .with_shadow_slots(shadow_slots)
            .with_device_inflight(device_inflight.unwrap_or_else(|| vec![None; n_paths]))
            .with_device_sharing(match device_sharing {
                None => vec![Sharing::Shared; n_paths],
                Some(ways) => ways
                    .iter()
                    .map(|w| w.parse())
                    .collect::<mlp_offload_core::Result<_>>()
                    .map_err(to_py)?,
            });
        if let Some(w) = weights {
            config = config.with_weights(w);
        }
        let store = py.detach(|| ObjectStore::open(config)).map_err(to_py)?;
        Ok(PyObjectStore {
            store: std::sync::RwLock::new(Some(Arc::new(store))),
        })
    }

    /// Writes `nbytes` at `address` as object `key`; `owner` (the tensor or buffer that owns the memory)
    /// is kept alive until the write is done. `staged`: the new version waits beside the current one
    /// until `commit` (or `discard`).
    #[pyo3(signature = (key, address, nbytes, owner, weights=None, sums=None, staged=false))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        key: &str,
        address: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        weights: Option<Vec<f64>>,
        sums: Option<(Vec<u64>, Vec<u32>)>,
        staged: bool,
    ) -> PyResult<IoHandle> {
        let store = self.get()?;
        let ptr = HostPtr(address as *mut u8);
        let sums = sums.map(|(starts, sums)| StripeSums { starts, sums });
        let completion = py
            .detach(|| {
                let (weights, owner) = (weights.as_deref(), Box::new(owner));
                // SAFETY: the caller (the Python layer) passes the address and size of a live, contiguous
                // CPU buffer owned by `owner`, and sums it computed over those bytes; `owner` is held by
                // the completion until the I/O is done.
                unsafe {
                    if staged {
                        store.stage_raw_with_sums(key, ptr, nbytes, owner, weights, sums)
                    } else {
                        store.write_raw_with_sums(key, ptr, nbytes, owner, weights, sums)
                    }
                }
            })
            .map_err(to_py)?;
        Ok(IoHandle { completion })
    }

    /// Makes the staged version of `key` current (after its write completes); ValueError naming the
    /// key when there is none.
    fn commit(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.commit(key)).map_err(to_py)
    }

    /// Forgets the staged version of `key` (after its write completes); whether there was one.
    fn discard(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let store = self.get()?;
        py.detach(|| store.discard(key)).map_err(to_py)
    }

    /// Gives `key` a second slot of its own (its blocks reserved now), so it takes staged writes in a
    /// store with shadow slots off; the bytes reserved, 0 when it had two. OSError (ENOSPC) naming the
    /// file when the path is full, the object as it was.
    fn add_shadow_slot(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        let store = self.get()?;
        py.detach(|| store.add_shadow_slot(key)).map_err(to_py)
    }

    /// Gives back the second slot `add_shadow_slot` gave `key`, once its current version is in slot 0:
    /// the bytes given back (0 when it had one slot), None when it is in slot 1 (ask after its next
    /// write). ValueError naming the key while a staged version waits, or with shadow slots on.
    fn remove_shadow_slot(&self, py: Python<'_>, key: &str) -> PyResult<Option<u64>> {
        let store = self.get()?;
        py.detach(|| store.remove_shadow_slot(key)).map_err(to_py)
    }

    /// How many slots `key` has on disk: 2 where it takes staged writes, else 1.
    fn slots(&self, key: &str) -> PyResult<u32> {
        self.get()?.slots(key).map_err(to_py)
    }

    /// Where each stripe of an `nbytes` object written now would start (the current weights' split).
    fn write_cuts(&self, nbytes: u64) -> PyResult<Vec<u64>> {
        self.get()?.write_cuts(nbytes).map_err(to_py)
    }

    /// What a read of `key` reads now, for `verify`: take it after a read with `verify=False`.
    fn read_check(&self, key: &str) -> PyResult<PyReadCheck> {
        let check = self.get()?.read_check(key).map_err(to_py)?;
        Ok(PyReadCheck { check })
    }

    /// Compares a read's stripe sums (the caller's) with the stored ones: `CorruptObjectError` naming the
    /// stripe's file on a mismatch.
    fn verify(&self, check: &PyReadCheck, sums: Vec<u32>) -> PyResult<()> {
        self.get()?.verify(&check.check, &sums).map_err(to_py)
    }

    /// Reads object `key` into `nbytes` at `address`; `owner` is kept alive until the read is done. With
    /// `verify=False` the store does not check its checksums: the caller does (`read_check`, `verify`).
    #[pyo3(signature = (key, address, nbytes, owner, verify=true))]
    fn read(
        &self,
        py: Python<'_>,
        key: &str,
        address: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        verify: bool,
    ) -> PyResult<IoHandle> {
        let store = self.get()?;
        let ptr = HostPtr(address as *mut u8);
        let completion = py
            .detach(|| {
                // SAFETY: as in `write`; the buffer is writable memory owned by `owner`.
                unsafe {
                    if verify {
                        store.read_raw(key, ptr, nbytes, Box::new(owner))
                    } else {
                        store.read_raw_unverified(key, ptr, nbytes, Box::new(owner))
                    }
                }
            })
            .map_err(to_py)?;
        Ok(IoHandle { completion })
    }

    fn delete(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.delete(key)).map_err(to_py)
    }

    /// Waits for everything in flight, flushes to stable storage and writes the manifest.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.sync()).map_err(to_py)
    }

    /// Syncs and releases the engines; later calls raise ValueError. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(store) = self.store.write().expect("store lock").take() else {
            return Ok(());
        };
        py.detach(move || {
            let result = store.sync();
            drop(store);
            result
        })
        .map_err(to_py)
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.keys())
    }

    fn size(&self, key: &str) -> PyResult<Option<u64>> {
        Ok(self.get()?.size(key))
    }

    /// `[(path_index, nbytes), ...]`, one per stripe.
    fn placement(&self, key: &str) -> PyResult<Vec<(usize, u64)>> {
        self.get()?.placement(key).map_err(to_py)
    }

    /// Whether a CRC32C of every stripe is kept and checked.
    #[getter]
    fn checksum(&self) -> PyResult<bool> {
        Ok(self.get()?.config().checksum())
    }

    #[getter]
    fn engine(&self) -> PyResult<&'static str> {
        Ok(self.get()?.engine_kind().name())
    }

    #[getter]
    fn tiers(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_json(py, &self.get()?.tiers())
    }

    /// Per path: tier facts, engine, limits and counters (bytes read/written, in-flight maximum,
    /// nanoseconds busy).
    fn path_reports(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_json(py, &self.get()?.path_reports())
    }

    /// The placement weights of the next write; assigning moves each object to the new split on its
    /// next write.
    #[getter]
    fn weights(&self) -> PyResult<Vec<f64>> {
        Ok(self.get()?.weights())
    }

    #[setter]
    fn set_weights(&self, weights: Vec<f64>) -> PyResult<()> {
        self.get()?.set_weights(&weights).map_err(to_py)
    }
}

/// Keeps placement weights balanced by the time each path was busy, step by step (see the core's
/// `WeightTuner`).
#[pyclass(module = "mlp_offload._core", name = "WeightTuner")]
struct PyWeightTuner {
    tuner: WeightTuner,
}

#[pymethods]
impl PyWeightTuner {
    #[new]
    #[pyo3(signature = (bytes_per_s, *, smoothing=0.5, tolerance=0.05))]
    fn new(bytes_per_s: Vec<f64>, smoothing: f64, tolerance: f64) -> PyResult<Self> {
        Ok(PyWeightTuner {
            tuner: WeightTuner::new(bytes_per_s, smoothing, tolerance).map_err(to_py)?,
        })
    }

    #[getter]
    fn weights(&self) -> Vec<f64> {
        self.tuner.weights().to_vec()
    }

    /// The weights of the last kept move (the split settled on so far, without a move on trial).
    #[getter]
    fn kept_weights(&self) -> Vec<f64> {
        self.tuner.kept_weights().to_vec()
    }

    #[getter]
    fn estimates(&self) -> Vec<f64> {
        self.tuner.estimates().to_vec()
    }

    /// One step's figures per path, dicts with `read_bytes`, `read_busy_secs`, `write_bytes`,
    /// `write_busy_secs` and `busy_secs`, and the step's time in seconds; returns the new weights when
    /// they moved, else None.
    fn observe(
        &mut self,
        samples: Vec<Bound<'_, PyAny>>,
        step_secs: f64,
    ) -> PyResult<Option<Vec<f64>>> {
        let samples: Vec<PathSample> = from_dicts(&samples, "samples")?;
        self.tuner.observe(&samples, step_secs).map_err(to_py)
    }

    /// Steps ran that the tuner did not see (another split, a pause): a move on trial is undone and
    /// judging starts afresh. Returns the weights to use from here.
    fn interrupted(&mut self) -> Vec<f64> {
        self.tuner.interrupted()
    }
}

impl Drop for PyObjectStore {
    fn drop(&mut self) {
        // Dropping the store syncs it, which may block on I/O: do it without the GIL.
        if let Some(store) = self.store.get_mut().expect("store lock").take() {
            Python::attach(|py| py.detach(move || drop(store)));
        }
    }
}

/// Facts about one directory: alignment, O_DIRECT support (tested), device identity.
#[pyfunction]
fn probe_directory(py: Python<'_>, path: PathBuf) -> PyResult<Py<PyAny>> {
    let info = py
        .detach(|| mlp_offload_core::probe_dir(&path))
        .map_err(to_py)?;
    to_py_json(py, &info)
}

/// Probes each directory (read and write over a sweep of chunk sizes and in-flight limits, then mixed
/// read+write), then all of them at once. `progress`, if given, is called with a line per measurement.
#[pyfunction]
#[pyo3(signature = (paths, *, bytes=None, sustained_bytes=None, chunk_sizes=None, depths=None,
                    engine="auto", together_secs=None, ranks=None, progress=None))]
#[allow(clippy::too_many_arguments)]
fn probe_bandwidth(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    bytes: Option<u64>,
    sustained_bytes: Option<u64>,
    chunk_sizes: Option<Vec<usize>>,
    depths: Option<Vec<usize>>,
    engine: &str,
    together_secs: Option<f64>,
    ranks: Option<usize>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Py<PyAny>> {
    let defaults = ProbeOptions::default();
    let together = match together_secs {
        None => defaults.together,
        Some(secs) => Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                to_py(Error::config(
                    "together_secs",
                    format!("{secs} is not a positive number of seconds"),
                ))
            })?,
    };
    let opts = ProbeOptions {
        bytes: bytes.unwrap_or(defaults.bytes),
        sustained_bytes: sustained_bytes.unwrap_or(defaults.sustained_bytes),
        chunk_sizes: chunk_sizes.unwrap_or(defaults.chunk_sizes),
        depths: depths.unwrap_or(defaults.depths),
        engine: engine.parse().map_err(to_py)?,
        together,
        ranks: ranks.unwrap_or(defaults.ranks).max(1),
    };
    let result = py.detach(|| {
        probe_paths(&paths, &opts, &mut |line| {
            if let Some(cb) = &progress {
                // Progress lines are advisory; a failing callback must not abort the probe.
                Python::attach(|py| {
                    if let Err(e) = cb.call1(py, (line,)) {
                        e.print(py);
                    }
                });
            }
        })
    });
    to_py_json(py, &result.map_err(to_py)?)
}

/// One node's part of measuring a shared directory with the other nodes (see the core's
/// `probe_across_nodes`): writes a probe file of `working_bytes`, then for each of `steps` calls
/// `step(i)`, the caller's barrier across the nodes, which returns the seconds this node measures in
/// that window, or None to wait; measures mixed reads and writes that long when it does. Returns one
/// rate (bytes per second) or None per window. An exception `step` raises ends the probe and is raised
/// again.
#[pyfunction]
#[pyo3(signature = (path, *, chunk_size, max_inflight, pages, expected_bytes_per_s, working_bytes,
                    steps, step, engine="auto"))]
#[allow(clippy::too_many_arguments)]
fn probe_shared_path(
    py: Python<'_>,
    path: PathBuf,
    chunk_size: usize,
    max_inflight: usize,
    pages: &str,
    expected_bytes_per_s: f64,
    working_bytes: u64,
    steps: usize,
    step: Py<PyAny>,
    engine: &str,
) -> PyResult<Vec<Option<f64>>> {
    let limits = PathLimits {
        chunk_size,
        max_inflight,
    };
    let pages = Pages::parse("pages", pages).map_err(to_py)?;
    let engine = engine.parse().map_err(to_py)?;
    // The callback's own exception, raised again in place of the core error that stops the probe.
    let mut raised: Option<PyErr> = None;
    let result = py.detach(|| {
        probe_across_nodes(
            &path,
            engine,
            limits,
            pages,
            expected_bytes_per_s,
            working_bytes,
            steps,
            &mut |i| {
                Python::attach(|py| {
                    let window = step
                        .call1(py, (i,))
                        .and_then(|r| r.extract::<Option<f64>>(py))
                        .and_then(|secs| {
                            secs.map(|secs| {
                                Duration::try_from_secs_f64(secs).map_err(|_| {
                                    to_py(Error::config(
                                        "step",
                                        format!("window {i}: {secs} is not a number of seconds"),
                                    ))
                                })
                            })
                            .transpose()
                        });
                    window.map_err(|e| {
                        raised = Some(e);
                        Error::config("step", format!("the callback of window {i} raised"))
                    })
                })
            },
        )
    });
    match (result, raised) {
        (_, Some(e)) => Err(e),
        (result, None) => result.map_err(to_py),
    }
}

/// The performance model's plan for one update phase. `paths` holds one dict per path with
/// `device_id`, `read_bytes_per_s`, `write_bytes_per_s`, `best_inflight` and optionally
/// `mixed_bytes_per_s` and `concurrent_bytes_per_s` (a probe's figures). `weights`, one per path:
/// plan at that split instead of the model's own. `param_bytes`: the parameters kept on the paths
/// (ZeRO-Infinity's), read by the forward and the backward and written by the update.
#[pyfunction]
#[pyo3(signature = (paths, *, subgroups, read_bytes_per_subgroup, write_bytes_per_subgroup,
                    host_bytes_per_subgroup, host_memory, pipeline_buffers=3, adam_secs_per_subgroup=0.0,
                    fwd_bwd_secs=0.0, weights=None, param_bytes=0))]
#[allow(clippy::too_many_arguments)]
fn plan_update(
    py: Python<'_>,
    paths: Vec<Bound<'_, PyAny>>,
    subgroups: usize,
    read_bytes_per_subgroup: u64,
    write_bytes_per_subgroup: u64,
    host_bytes_per_subgroup: u64,
    host_memory: u64,
    pipeline_buffers: usize,
    adam_secs_per_subgroup: f64,
    fwd_bwd_secs: f64,
    weights: Option<Vec<f64>>,
    param_bytes: u64,
) -> PyResult<Py<PyAny>> {
    let profiles: Vec<PathProfile> = from_dicts(&paths, "paths")?;
    let work = UpdateWorkload {
        subgroups,
        read_bytes_per_subgroup,
        write_bytes_per_subgroup,
        host_bytes_per_subgroup,
        host_memory,
        pipeline_buffers,
        adam_secs_per_subgroup,
        fwd_bwd_secs,
        param_bytes,
    };
    let planned = plan_split(&profiles, &work, weights.as_deref()).map_err(to_py)?;
    to_py_json(py, &planned)
}

/// Which of a step's chunks the accelerator updates beside the host (Deep Optimizer States) and the
/// time that split predicts: `inputs` a dict of `accelerator_update::SplitInputs`' fields (the chunks'
/// elements in the step's order, the measured rates, the memory), the result a dict of `Split`'s.
#[pyfunction]
fn accelerator_split(py: Python<'_>, inputs: Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let inputs: SplitInputs = depythonize(&inputs)
        .map_err(|e| to_py(Error::config("accelerator_split", e.to_string())))?;
    let chosen = py.detach(|| split_update(&inputs)).map_err(to_py)?;
    to_py_json(py, &chosen)
}

/// The host buffers' pages the probe's figures call for (`"huge"` or `"small"`): one dict per path with
/// the `small_`/`huge_` `read_`/`write_bytes_per_s` of its `pages` probe.
#[pyfunction]
fn pages_choice(paths: Vec<Bound<'_, PyAny>>) -> PyResult<&'static str> {
    let rates: Vec<PageRates> = from_dicts(&paths, "paths")?;
    Ok(choose_pages(&rates).name())
}

/// The block counters of device `major:minor` (`ObjectStore.path_reports()[i]["tier"]["device_id"]`),
/// as a tuple to pass to `block_activity`, or None for a device without them.
#[pyfunction]
fn block_counters(device_id: &str) -> Option<[u64; 8]> {
    BlockCounters::read(device_id).map(|c| {
        [
            c.read_requests,
            c.read_merges,
            c.read_sectors,
            c.write_requests,
            c.write_merges,
            c.write_sectors,
            c.io_ms,
            c.queue_ms,
        ]
    })
}

/// What reached the device between two `block_counters` readings `secs` apart: bytes and requests per
/// direction, their mean sizes, the merged shares, the mean queue depth and the busy share.
#[pyfunction]
fn block_activity(
    py: Python<'_>,
    before: [u64; 8],
    after: [u64; 8],
    secs: f64,
) -> PyResult<Py<PyAny>> {
    let counters = |c: [u64; 8]| BlockCounters {
        read_requests: c[0],
        read_merges: c[1],
        read_sectors: c[2],
        write_requests: c[3],
        write_merges: c[4],
        write_sectors: c[5],
        io_ms: c[6],
        queue_ms: c[7],
    };
    let activity = BlockActivity::between(&counters(before), &counters(after), secs);
    to_py_json(py, &activity)
}

/// The CRC32C of `nbytes` at `address` (a buffer-protocol object's memory: `HostBuffer.address`,
/// `Tensor.data_ptr()`), as the store keeps it per stripe; computed without the GIL.
#[pyfunction]
fn crc32c(py: Python<'_>, buffer: Bound<'_, PyAny>) -> PyResult<u32> {
    let view = pyo3::buffer::PyBuffer::<u8>::get(&buffer)?;
    if !view.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer: must be contiguous"));
    }
    let (address, len) = (view.buf_ptr() as usize, view.len_bytes());
    Ok(py.detach(|| {
        // SAFETY: the buffer view keeps the exporter's memory alive and in place until it is dropped,
        // after this closure returns; CRC only reads it.
        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
        mlp_offload_core::checksum::crc32c(bytes)
    }))
}

/// Why io_uring cannot be used in this process, or None when it can.
#[pyfunction]
fn io_uring_unavailable_reason() -> Option<String> {
    mlp_offload_core::engine::uring_unavailable_reason()
}

/// Rust `log` records to Python's `logging` (`pyo3_log`, its default filter: debug) while the
/// interpreter runs, and to standard error once it is shutting down: a store closed there by one of its
/// own threads (its last request done) may still log, and `pyo3_log` would panic attaching to it.
struct RecordsToPython(pyo3_log::Logger);

impl log::Log for RecordsToPython {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if Python::try_attach(|_| self.0.log(record)).is_none() {
            eprintln!("{} {}: {}", record.level(), record.target(), record.args());
        }
    }

    fn flush(&self) {
        self.0.flush();
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust `log` records go to Python's `logging` (logger names start with `mlp_offload_core`).
    if log::set_boxed_logger(Box::new(RecordsToPython(pyo3_log::Logger::default()))).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "CorruptObjectError",
        m.py().get_type::<CorruptObjectError>(),
    )?;
    m.add_class::<IoHandle>()?;
    m.add_class::<HostBuffer>()?;
    m.add_class::<HostBufferPool>()?;
    m.add_class::<PyObjectStore>()?;
    m.add_class::<PyReadCheck>()?;
    m.add_class::<PyWeightTuner>()?;
    m.add_class::<AdamKernel>()?;
    m.add_class::<PyAdamGroup>()?;
    m.add_class::<PyChunkArrays>()?;
    m.add_class::<PyStateLayout>()?;
    m.add_function(wrap_pyfunction!(probe_directory, m)?)?;
    m.add_function(wrap_pyfunction!(probe_shared_path, m)?)?;
    m.add_function(wrap_pyfunction!(probe_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(io_uring_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(plan_update, m)?)?;
    m.add_function(wrap_pyfunction!(accelerator_split, m)?)?;
    m.add_function(wrap_pyfunction!(pages_choice, m)?)?;
    m.add_function(wrap_pyfunction!(block_counters, m)?)?;
    m.add_function(wrap_pyfunction!(block_activity, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    Ok(())
}
