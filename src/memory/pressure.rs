//! Owns simulated memory pressure (`memory.pressure`): real tensors held over a range of steps.
//! Keeps: the tensors are released when the range ends, so the guard can grow back.
use tch::{Device, Kind, Tensor};

use super::{parse_size, Pressure};

pub struct PressureSchedule {
    entries: Vec<(Pressure, Option<Tensor>)>,
    device: Device,
}

impl PressureSchedule {
    pub fn new(pressure: &[Pressure], device: Device) -> PressureSchedule {
        PressureSchedule {
            entries: pressure.iter().map(|p| (p.clone(), None)).collect(),
            device,
        }
    }

    /// Holds or releases each entry's memory for `step`.
    pub fn update(&mut self, step: u64) {
        for (p, held) in &mut self.entries {
            let active = (p.from_step..p.to_step).contains(&step);
            if active && held.is_none() {
                let bytes = parse_size(&p.size).unwrap_or(0) as i64;
                // ones, not zeros: the pages are touched, as a real tenant's would be.
                match Tensor::f_ones([bytes / 4], (Kind::Float, self.device)) {
                    Ok(t) => {
                        tracing::info!(
                            "memory pressure: holding {} from step {} to {}",
                            p.size,
                            p.from_step,
                            p.to_step
                        );
                        *held = Some(t);
                    }
                    Err(e) => tracing::warn!("memory pressure: could not hold {}: {e}", p.size),
                }
            } else if !active && held.is_some() {
                tracing::info!("memory pressure: released {} at step {step}", p.size);
                *held = None;
            }
        }
    }
}
