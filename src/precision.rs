//! Owns mixed precision (`train.precision`): autocast, and fp16's dynamic loss scaling.
//! Keeps: master weights, gradients and optimizer state stay fp32; an fp16 step with inf or nan
//! gradients is skipped.
use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_void};
use tch::{Device, Kind, TchError, Tensor};

use crate::error::ConfigError;
use crate::memory::check;
use crate::ops::scalar;

extern "C" {
    fn og_cuda_bf16_native() -> i32;
    fn og_autocast_enter(cuda: i32, half: i32, was_enabled: *mut i32, was_dtype: *mut i32) -> *mut c_char;
    fn og_autocast_exit(cuda: i32, was_enabled: i32, was_dtype: i32) -> *mut c_char;
    fn og_amp_unscale(grads: *const *mut c_void, n: i32, found_inf: *mut c_void, inv_scale: *mut c_void)
        -> *mut c_char;
    fn og_amp_update_scale(
        scale: *mut c_void,
        growth_tracker: *mut c_void,
        found_inf: *mut c_void,
        growth: f64,
        backoff: f64,
        interval: i64,
    ) -> *mut c_char;
}

/// The precision a run computes its forward in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    /// Bytes per activation value.
    pub fn activation_bytes(self) -> f64 {
        if self == Precision::Fp32 {
            4.0
        } else {
            2.0
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// `train.precision` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionConfig {
    #[default]
    Auto,
    Fp32,
    Bf16,
    Fp16,
}

impl PrecisionConfig {
    /// The precision for `device`: `auto` is bf16 on a GPU that runs it natively, else fp32.
    pub fn resolve(self, device: Device) -> Precision {
        match self {
            PrecisionConfig::Auto if bf16_is_fast(device) => Precision::Bf16,
            PrecisionConfig::Auto | PrecisionConfig::Fp32 => Precision::Fp32,
            PrecisionConfig::Bf16 => Precision::Bf16,
            PrecisionConfig::Fp16 => Precision::Fp16,
        }
    }
}

/// Whether bf16 is native (and so faster) on `device`: an Ampere or newer GPU. On the CPU
/// oomguard assumes it is not (AVX2 machines emulate it; it saves memory, not time).
pub fn bf16_is_fast(device: Device) -> bool {
    device.is_cuda() && unsafe { og_cuda_bf16_native() } == 1
}

/// Autocast on while it lives (thread-local, nestable).
pub struct Autocast {
    cuda: i32,
    was: (i32, i32),
}

impl Autocast {
    /// Autocast for `precision` on `device`; `None` for fp32.
    pub fn enter(precision: Precision, device: Device) -> Result<Option<Autocast>, TchError> {
        let half = match precision {
            Precision::Fp32 => return Ok(None),
            Precision::Bf16 => 0,
            Precision::Fp16 => 1,
        };
        let cuda = device.is_cuda() as i32;
        let (mut enabled, mut dtype) = (0, 0);
        check(unsafe { og_autocast_enter(cuda, half, &mut enabled, &mut dtype) })?;
        Ok(Some(Autocast {
            cuda,
            was: (enabled, dtype),
        }))
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        if let Err(e) = check(unsafe { og_autocast_exit(self.cuda, self.was.0, self.was.1) }) {
            tracing::warn!("leaving autocast: {e}");
        }
    }
}

/// How a micro-batch's forward and backward run: autocast, and the fp16 loss scale.
#[derive(Clone, Copy)]
pub struct Amp<'a> {
    pub precision: Precision,
    pub device: Device,
    pub loss_scale: Option<&'a Tensor>,
}

impl<'a> Amp<'a> {
    pub fn fp32(device: Device) -> Amp<'static> {
        Amp {
            precision: Precision::Fp32,
            device,
            loss_scale: None,
        }
    }
    pub fn autocast(&self) -> Result<Option<Autocast>, TchError> {
        Autocast::enter(self.precision, self.device)
    }
    /// The loss to call backward on: scaled by the fp16 loss scale, if any.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor, TchError> {
        match self.loss_scale {
            Some(s) => loss.f_mul(s),
            None => Ok(loss.shallow_clone()),
        }
    }
}

/// `train.grad_scaler`: fp16's dynamic loss scaling, GradScaler's arguments under its
/// names and with its defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradScalerConfig {
    /// The loss scale at the start.
    pub init_scale: f64,
    /// The scale is multiplied by this after `growth_interval` clean steps in a row...
    pub growth_factor: f64,
    /// ...and by this on a step whose gradients overflow (the step is skipped).
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl GradScalerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| Err(ConfigError::invalid(&format!("train.grad_scaler.{key}"), message));
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(
                "init_scale",
                format!(
                    "is {}; it must be a positive number (GradScaler's default: 65536)",
                    self.init_scale
                ),
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "growth_factor",
                format!("is {}; it must be above 1 (default 2.0)", self.growth_factor),
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                format!("is {}; it must be between 0 and 1 (default 0.5)", self.backoff_factor),
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", "is 0; it must be at least 1 (default 2000)".into());
        }
        Ok(())
    }
}

/// Dynamic loss scaling for fp16.
pub struct Scaler {
    pub scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    cfg: GradScalerConfig,
}

impl Scaler {
    pub fn new(cfg: &GradScalerConfig, device: Device) -> Result<Scaler, TchError> {
        Ok(Scaler {
            cfg: cfg.clone(),
            scale: scalar(cfg.init_scale, Kind::Float, device)?,
            growth_tracker: Tensor::f_zeros([], (Kind::Int, device))?,
            found_inf: Tensor::f_zeros([], (Kind::Float, device))?,
        })
    }

    /// Unscales the gradients in place and sets `found_inf` (on the device, not read here) to
    /// 1 if any is inf or nan: the update is then skipped on the device.
    pub fn unscale(&self, grads: &[Tensor]) -> Result<(), TchError> {
        let inv = self.scale.f_reciprocal()?;
        let _ = self.found_inf.shallow_clone().f_zero_()?;
        let ptrs: Vec<*mut c_void> = grads.iter().map(|t| t.as_ptr() as *mut c_void).collect();
        check(unsafe {
            og_amp_unscale(
                ptrs.as_ptr(),
                ptrs.len() as i32,
                self.found_inf.as_ptr() as *mut c_void,
                inv.as_ptr() as *mut c_void,
            )
        })
    }

    /// The last `unscale`'s overflow flag (1.0 or 0.0), on the device.
    pub fn found_inf(&self) -> &Tensor {
        &self.found_inf
    }

    /// After the step: back off if it was skipped, else count towards growing.
    pub fn update(&self) -> Result<(), TchError> {
        let p = |t: &Tensor| t.as_ptr() as *mut c_void;
        let c = &self.cfg;
        check(unsafe {
            og_amp_update_scale(
                p(&self.scale),
                p(&self.growth_tracker),
                p(&self.found_inf),
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval.into(),
            )
        })
    }

    /// The scale, read from the device (checkpoints and tests; a step reads it with its
    /// read-out).
    pub fn value(&self) -> f64 {
        crate::ops::read_one(&self.scale).unwrap_or(f64::NAN)
    }

    /// (scale, growth tracker), for checkpoints.
    pub fn state(&self) -> (f64, i64) {
        (
            self.value(),
            crate::ops::read_one(&self.growth_tracker).map_or(0, |t| t as i64),
        )
    }

    pub fn load_state(&self, scale: f64, tracker: i64) -> Result<(), TchError> {
        let device = self.scale.device();
        self.scale
            .shallow_clone()
            .f_copy_(&scalar(scale, Kind::Float, device)?)?;
        self.growth_tracker
            .shallow_clone()
            .f_copy_(&scalar(tracker as f64, Kind::Int, device)?)?;
        Ok(())
    }
}
