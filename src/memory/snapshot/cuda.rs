//! Owns the CUDA snapshot path: libtorch's recorder, taken by an OOM observer before unwinding.
//! Keeps: the pickle is written as libtorch made it; only the summary is derived.
use std::collections::BTreeMap;
use std::ffi::c_char;
use std::io;

use serde_pickle::{HashableValue as K, Value as V};

use super::summary::{self, Breakdown, Category, Context, Roles};
use super::{Capture, Info, Rec, ALLOC, FREE, OOM};

extern "C" {
    fn og_cuda_snap_start(max_events: i64) -> *mut c_char;
    fn og_cuda_snap_take(last_oom: i32, out: *mut *mut c_char, len: *mut i64, info: *mut i64) -> *mut c_char;
    fn og_free(p: *mut c_char);
}

pub fn start(max_events: usize) -> Result<(), tch::TchError> {
    crate::memory::check(unsafe { og_cuda_snap_start(max_events as i64) })
}

fn take(last_oom: bool) -> Result<(Vec<u8>, [i64; 4]), tch::TchError> {
    let (mut out, mut len, mut info) = (std::ptr::null_mut(), 0i64, [0i64; 4]);
    crate::memory::check(unsafe { og_cuda_snap_take(last_oom as i32, &mut out, &mut len, info.as_mut_ptr()) })?;
    // SAFETY: on success out holds len malloc'd bytes, ours to free.
    let bytes = unsafe { std::slice::from_raw_parts(out as *const u8, len.max(0) as usize) }.to_vec();
    unsafe { og_free(out) };
    Ok((bytes, info))
}

fn get<'a>(v: &'a V, key: &str) -> Option<&'a V> {
    match v {
        V::Dict(d) => d.get(&K::String(key.into())),
        _ => None,
    }
}

fn int(v: Option<&V>) -> i64 {
    match v {
        Some(V::I64(i)) => *i,
        _ => 0,
    }
}

fn list(v: Option<&V>) -> &[V] {
    match v {
        Some(V::List(l)) => l,
        _ => &[],
    }
}

/// The capture the observer took at the OOM (or one now), its summary and its bytes.
pub fn capture(
    ctx: &mut Context,
    oom: bool,
    roles: &Roles,
    plan: Option<BTreeMap<Category, u64>>,
) -> io::Result<(Breakdown, Vec<u8>)> {
    let (bytes, info) = take(oom).map_err(io::Error::other)?;
    let snap: V = serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new().replace_unresolved_globals())
        .map_err(io::Error::other)?;
    let mut cap = Capture::default();
    let (mut reserved, mut largest_free) = (0u64, 0u64);
    for seg in list(get(&snap, "segments")) {
        reserved += int(get(seg, "total_size")) as u64;
        for b in list(get(seg, "blocks")) {
            let size = int(get(b, "size"));
            if let Some(V::String(s)) = get(b, "state") {
                if s == "active_allocated" {
                    let seq = cap.live.len() as u64;
                    cap.live.push(Rec {
                        addr: int(get(b, "address")) as u64,
                        size,
                        seq,
                        action: ALLOC,
                        ..Default::default()
                    });
                } else if s == "inactive" {
                    largest_free = largest_free.max(size as u64);
                }
            }
        }
    }
    for e in list(get(&snap, "device_traces")).iter().flat_map(|d| list(Some(d))) {
        let action = match get(e, "action") {
            Some(V::String(a)) if a == "alloc" => ALLOC,
            Some(V::String(a)) if a == "free_completed" => FREE,
            Some(V::String(a)) if a == "oom" => OOM,
            _ => continue,
        };
        cap.events.push(Rec {
            action,
            addr: int(get(e, "addr")) as u64,
            size: int(get(e, "size")),
            time_us: int(get(e, "time_us")),
            ..Default::default()
        });
    }
    cap.info = Info {
        seq: cap.live.len() as u64,
        op_seq: cap.live.len() as u64,
        events_written: cap.events.len() as u64,
        ..Default::default()
    };
    ctx.reserved_bytes = Some(reserved);
    ctx.largest_free_block_bytes = Some(largest_free);
    if oom {
        ctx.free_bytes = u64::try_from(info[3]).ok();
        ctx.limit_bytes = crate::memory::stats(tch::Device::Cuda(info[0].max(0) as usize)).limit_bytes;
    }
    let summary = summary::breakdown(&cap, roles, ctx, &|_| String::new(), plan);
    Ok((summary, bytes))
}
