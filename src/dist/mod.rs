//! Owns data-parallel training over libtorch's c10d: Gloo on the CPU, NCCL on CUDA.
//! Keeps: the ranks agree on each attempt's status before any gradient traffic, so all shrink
//! together and none waits in a collective the others will not join.
use std::ffi::{c_char, c_void, CString};
use std::ops::Range;
use std::time::Duration;
use tch::{Device, TchError, Tensor};

use crate::error::{ConfigError, Error, OomError, OomSource, Phase, Result};
use crate::memory::check;

pub mod bind;
pub mod cost;
pub mod elastic;
pub mod exchange;
pub mod overlap;

pub use exchange::Topic;
use exchange::{Channel, Exchange, Reduce, PAYLOAD};
pub use overlap::{Reducer, Segments, DEFAULT_BUCKET_BYTES};

extern "C" {
    fn og_dist_init(
        addr: *const c_char,
        port: i32,
        token: *const c_char,
        rank: i32,
        world: i32,
        cuda_index: i32,
        gloo_host: *const c_char,
        timeout_ms: i64,
        shm: i32,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn og_dist_free(group: *mut c_void);
    fn og_dist_transport(group: *mut c_void, note: *mut *const c_char) -> *const c_char;
    fn og_dist_all_reduce(group: *mut c_void, tensors: *const *mut c_void, n: i32, op: i32) -> *mut c_char;
    fn og_dist_broadcast(group: *mut c_void, tensors: *const *mut c_void, n: i32, root: i32) -> *mut c_char;
    fn og_dist_reduce_scatter(
        group: *mut c_void,
        input: *mut c_void,
        out: *mut c_void,
        fallback: *mut i32,
    ) -> *mut c_char;
    fn og_dist_all_gather_start(
        group: *mut c_void,
        input: *mut c_void,
        out: *mut c_void,
        fallback: *mut i32,
        started: *mut *mut c_void,
    ) -> *mut c_char;
    fn og_dist_gathered(started: *mut c_void, wait: i32) -> *mut c_char;
    fn og_dist_store_set(group: *mut c_void, key: *const c_char, data: *const u8, len: i64) -> *mut c_char;
    fn og_dist_store_get(group: *mut c_void, key: *const c_char, out: *mut *mut u8, len: *mut i64) -> *mut c_char;
    fn og_free(p: *mut c_char);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Sum = 0,
    Max = 1,
    Min = 2,
}

/// The processes training together.
pub struct ProcessGroup {
    ptr: *mut c_void,
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    device: Device,
    exchange: Exchange,
    /// The fallbacks for a backend's missing collectives, said once each.
    said: std::cell::Cell<[bool; 2]>,
}

/// Where a rank joins its group: torchrun's variables, or a simulation's.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    /// MASTER_ADDR and MASTER_PORT: rank 0's store.
    pub addr: String,
    pub port: u16,
    /// The run's secret: a group whose store holds another is refused.
    pub token: String,
    pub timeout: Duration,
    /// Every rank runs on this host (the launcher's LOCAL_WORLD_SIZE is the world): the CPU's
    /// all-reduces and broadcasts go through shared memory (csrc/shm.cpp) where all ranks can
    /// map it, unless `OOMGUARD_DIST_SHM=0`.
    pub shared_memory: bool,
}

/// `OOMGUARD_DIST_SHM=0`: ranks on one host talk over Gloo's loopback TCP, as across hosts.
pub const SHM_VAR: &str = "OOMGUARD_DIST_SHM";

/// Whether ranks on one CPU host may reduce through shared memory (`SHM_VAR` is not `0`).
pub fn shared_memory_allowed() -> bool {
    std::env::var(SHM_VAR).map_or(true, |v| v.trim() != "0")
}

/// Set by `oomguard launch`: one value per launch (per `--rdzv-id` across nodes).
pub const TOKEN_VAR: &str = "OOMGUARD_RUN_TOKEN";

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        unsafe { og_dist_free(self.ptr) }
    }
}

fn ptrs(ts: &[Tensor]) -> Vec<*mut c_void> {
    ts.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

/// A collective that failed (a peer died, a timeout): the launcher restarts the group.
fn dist_error(what: &str) -> impl Fn(TchError) -> Error + '_ {
    move |e| Error::Dist(format!("{what}: {}", crate::task::error_line(&e.to_string())))
}

impl ProcessGroup {
    /// The group torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT); `None` for a single process. On CUDA each rank uses the
    /// GPU of its LOCAL_RANK (`device` names which kind).
    pub fn from_env(device: Device, timeout: Duration) -> Result<Option<ProcessGroup>> {
        let var = |k: &str| std::env::var(k).ok();
        let num = |k: &str, v: &str| -> Result<usize> {
            v.trim().parse().map_err(|_| {
                ConfigError {
                    origin: "environment".into(),
                    line_col: None,
                    key: k.into(),
                    message: format!("`{v}` is not a whole number"),
                }
                .into()
            })
        };
        let world = match var("WORLD_SIZE") {
            Some(w) => num("WORLD_SIZE", &w)?,
            None => return Ok(None),
        };
        // Diagnostic: `OOMGUARD_GROUP_OF_ONE=1` forms a group of one rank, so every collective
        // of a step runs on a machine with one GPU (NCCL refuses two ranks on one device).
        if world == 0 || (world == 1 && var("OOMGUARD_GROUP_OF_ONE").is_none_or(|v| v != "1")) {
            return Ok(None);
        }
        let rank = num("RANK", &var("RANK").unwrap_or_default())?;
        let local_rank = var("LOCAL_RANK")
            .map(|l| num("LOCAL_RANK", &l))
            .transpose()?
            .unwrap_or(rank);
        let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = num("MASTER_PORT", &var("MASTER_PORT").unwrap_or_else(|| "29500".into()))?;
        let local_world = var("LOCAL_WORLD_SIZE")
            .map(|l| num("LOCAL_WORLD_SIZE", &l))
            .transpose()?;
        check_env(rank, world, local_rank, local_world, port)?;
        // The launch's token, checked in the store before the group forms (TOKEN_VAR).
        let token = var(TOKEN_VAR)
            .or_else(|| var("TORCHELASTIC_RUN_ID"))
            .unwrap_or_default();
        let at = Rendezvous {
            rank,
            world,
            local_rank,
            addr,
            port: port as u16,
            token,
            timeout,
            shared_memory: local_world == Some(world) && shared_memory_allowed(),
        };
        ProcessGroup::join(&at, device).map(Some)
    }

    /// Rank `at.rank`'s place in the group `at` describes (rank 0 serves its store).
    pub fn join(at: &Rendezvous, device: Device) -> Result<ProcessGroup> {
        let Rendezvous {
            rank,
            world,
            local_rank,
            ref addr,
            port,
            ref token,
            timeout,
            shared_memory,
        } = *at;
        let device = match device {
            Device::Cuda(_) => Device::Cuda(local_rank),
            d => d,
        };
        let cuda = if let Device::Cuda(i) = device { i as i32 } else { -1 };
        let caddr = CString::new(addr.clone()).map_err(|_| Error::Dist("MASTER_ADDR holds a NUL byte".into()))?;
        let ctoken = CString::new(token.clone()).map_err(|_| Error::Dist(format!("{TOKEN_VAR} holds a NUL byte")))?;
        let host = gloo_host(addr)?;
        let chost = CString::new(host).map_err(|_| Error::Dist("an address holds a NUL byte".into()))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // Gloo's threads on the process's whole mask, not the rank's bound share.
        bind::unbound(|| {
            check(unsafe {
                og_dist_init(
                    caddr.as_ptr(),
                    i32::from(port),
                    ctoken.as_ptr(),
                    rank as i32,
                    world as i32,
                    cuda,
                    chost.as_ptr(),
                    timeout.as_millis() as i64,
                    i32::from(shared_memory && cuda < 0),
                    &mut ptr,
                )
            })
        })
        .map_err(dist_error(&format!(
            "rank {rank} of {world} joining the group at {addr}:{port}"
        )))?;
        let (transport, note) = unsafe {
            let mut note: *const c_char = std::ptr::null();
            let t = og_dist_transport(ptr, &mut note);
            let s = |p: *const c_char| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
            (s(t), s(note))
        };
        tracing::info!("rank {rank} of {world} ({transport}) joined the group at {addr}:{port}");
        if !note.is_empty() {
            tracing::warn!("rank {rank}: the ranks share this host, but their collectives go over Gloo's TCP: {note}");
        }
        let mut pg = ProcessGroup {
            ptr,
            rank,
            world,
            local_rank,
            device,
            exchange: Exchange::new(Channel::alone(), PAYLOAD),
            said: Default::default(),
        };
        let share = |k: &str, b: Option<&[u8]>| pg.share(k, b).map_err(|e| exchange::ExchangeError(e.to_string()));
        let channel = Channel::open(rank, world, addr, token, timeout, share)?;
        pg.exchange = Exchange::new(channel, PAYLOAD);
        Ok(pg)
    }

    /// The step the run is at, carried in every exchange's header.
    pub fn at_step(&self, step: u64) {
        self.exchange.step.set(step as i64);
    }

    /// One exchange of `payload` (at most the buffer's payload, reduced with MAX in place),
    /// after which every rank knows that all ranks were at the same exchange of the same
    /// step, or fails naming both views (exchange.rs).
    pub fn exchange(&self, topic: Topic, payload: &mut [f64]) -> Result<()> {
        Ok(self.exchange.run(topic, payload)?)
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// In place, across all ranks.
    pub fn all_reduce(&self, tensors: &[Tensor], op: Op) -> Result<()> {
        let p = ptrs(tensors);
        check(unsafe { og_dist_all_reduce(self.ptr, p.as_ptr(), p.len() as i32, op as i32) })
            .map_err(dist_error("all-reduce"))
    }

    /// The sum over ranks of one value each, added in the exchange tree's fixed order (the
    /// same on every rank, bitwise).
    pub fn sum_f64(&self, topic: Topic, value: f64) -> Result<f64> {
        let mut v = [value];
        self.exchange.run_as(topic, &mut v, Reduce::Sum)?;
        Ok(v[0])
    }

    /// The least over ranks of one value each (exact: a MAX of the negated).
    pub fn min_f64(&self, topic: Topic, value: f64) -> Result<f64> {
        let mut v = [-value];
        self.exchange.run_as(topic, &mut v, Reduce::Max)?;
        Ok(-v[0])
    }

    /// Bytes this rank has sent and received on the exchange so far.
    pub fn exchange_bytes(&self) -> u64 {
        self.exchange.bytes_moved()
    }

    /// ZeRO's reduce-scatter: `out` (S values) becomes the sum over ranks of their
    /// `input[rank*S..(rank+1)*S]`; `input` (world x S) is scratch.
    pub fn reduce_scatter(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        let mut fallback = 0;
        check(unsafe {
            og_dist_reduce_scatter(
                self.ptr,
                input.as_ptr() as *mut c_void,
                out.as_ptr() as *mut c_void,
                &mut fallback,
            )
        })
        .map_err(dist_error("reduce-scatter"))?;
        self.say_fallback(
            0,
            fallback,
            "reduce-scatter",
            "an in-place all-reduce, then this rank's slice (the same sums, twice the traffic)",
        );
        Ok(())
    }

    /// One of ZeRO's all-gathers: `out[r*S..(r+1)*S]` becomes rank r's `input` (S values).
    /// On Gloo it is left in flight (`Gathering::wait` completes it); elsewhere done here.
    pub fn all_gather_start(&self, input: &Tensor, out: &Tensor) -> Result<Gathering> {
        let (mut fallback, mut started) = (0, std::ptr::null_mut());
        check(unsafe {
            og_dist_all_gather_start(
                self.ptr,
                input.as_ptr() as *mut c_void,
                out.as_ptr() as *mut c_void,
                &mut fallback,
                &mut started,
            )
        })
        .map_err(dist_error("all-gather"))?;
        let instead = match fallback {
            3 => "one in-place broadcast from each rank (an all-gather's bytes)",
            _ => "an in-place all-reduce of the zero-padded shards (the same values, twice the traffic)",
        };
        self.say_fallback(1, fallback, "all-gather", instead);
        Ok(Gathering(started))
    }

    /// Says once how a ZeRO collective runs when not in its flat form: on Gloo by design
    /// (its flat forms allocate temporaries, which an OOM could fail after the ranks
    /// agreed), else because the backend lacks it.
    fn say_fallback(&self, which: usize, fallback: i32, what: &str, instead: &str) {
        let mut said = self.said.get();
        if fallback > 0 && !said[which] {
            said[which] = true;
            self.said.set(said);
            if self.rank == 0 {
                let why = match fallback {
                    2 | 3 => "Gloo's flat form allocates inside the collective, where an OOM would fail one rank after the ranks agreed",
                    _ => "this backend has no flat form",
                };
                tracing::info!("sharding: the {what} is {instead}: {why}");
            }
        }
    }

    /// Rank `root`'s values into every rank's tensors.
    pub fn broadcast(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        let p = ptrs(tensors);
        check(unsafe { og_dist_broadcast(self.ptr, p.as_ptr(), p.len() as i32, root as i32) })
            .map_err(dist_error("broadcast"))
    }

    /// Rank 0 publishes `bytes` under `key`; every rank gets them (waiting for them).
    pub fn share(&self, key: &str, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
        let k = CString::new(key).map_err(|_| Error::Dist("a store key holds a NUL byte".into()))?;
        if let Some(b) = bytes {
            check(unsafe { og_dist_store_set(self.ptr, k.as_ptr(), b.as_ptr(), b.len() as i64) })
                .map_err(dist_error("store set"))?;
        }
        let (mut out, mut len): (*mut u8, i64) = (std::ptr::null_mut(), 0);
        check(unsafe { og_dist_store_get(self.ptr, k.as_ptr(), &mut out, &mut len) })
            .map_err(dist_error("store get"))?;
        // SAFETY: on success `out` holds `len` bytes malloc'd by csrc/, ours to free.
        let v = unsafe { std::slice::from_raw_parts(out, len as usize) }.to_vec();
        unsafe { og_free(out as *mut c_char) };
        Ok(v)
    }

    /// This rank's part of a global batch of `global` samples.
    pub fn shard(&self, global: usize) -> Range<usize> {
        shard(global, self.world, self.rank)
    }

    /// The ranks' statuses after an attempt, agreed before any gradient traffic: every rank
    /// returns the same outcome. Another failure anywhere fails every rank (an OOM here
    /// too: no rank retries alone); else an OOM on any rank is an OOM on every rank, the
    /// same one everywhere (the lowest failing rank's phase, micro-batch and sizes), so
    /// the guards, which decide on them, decide alike.
    /// `topic`: the site's own, so that ranks at different sites fail at once, named.
    pub fn agree<T>(&self, topic: Topic, local: Result<T>) -> Result<T> {
        self.agree_with(topic, local, &mut [])
    }

    /// `agree`, with `also` (a few values) reduced by MAX over the ranks in the same exchange.
    pub fn agree_with<T>(&self, topic: Topic, local: Result<T>, also: &mut [f64]) -> Result<T> {
        // Which ranks failed, in O(1) values: the lowest rank with an OOM, and with another
        // error (-rank, under MAX; -inf for none).
        let me = -(self.rank as f64);
        let none = f64::NEG_INFINITY;
        let status = match &local {
            Ok(_) => [none, none],
            Err(Error::Oom(_)) => [me, none],
            Err(_) => [none, me],
        };
        let mut all = [&status[..], also].concat();
        self.exchange(topic, &mut all)?;
        also.copy_from_slice(&all[2..]);
        let v = [all[0], all[1]];
        if v[1] > none {
            let r = -v[1] as usize;
            return Err(match local {
                Err(e) if r == self.rank => e,
                _ => Error::Dist(format!("rank {r} failed (see its log)")),
            });
        }
        if v[0] == none {
            return local;
        }
        // The rare path: that rank's detail, which every rank then decides on.
        let r = -v[0] as usize;
        let mut d = [none; 5];
        if let Err(Error::Oom(o)) = &local {
            if r == self.rank {
                let n = |v: Option<u64>| v.map_or(-1.0, |v| v as f64);
                d = [
                    o.phase.map_or(-1.0, |p| p as u8 as f64),
                    n(o.micro_batch.map(|m| m as u64)),
                    n(o.requested_bytes),
                    n(o.free_bytes),
                    o.source as u8 as f64,
                ];
            }
        }
        self.exchange(topic, &mut d)?;
        let n = |x: f64| (x >= 0.0).then_some(x as u64);
        let (own_message, capacity) = match &local {
            Err(Error::Oom(o)) if r == self.rank => (Some(o.message.clone()), o.capacity_bytes),
            _ => (None, None),
        };
        let source = [
            OomSource::Cuda,
            OomSource::CudaRuntime,
            OomSource::Cpu,
            OomSource::Budget,
        ]
        .get(d[4] as usize)
        .copied()
        .unwrap_or(OomSource::Budget);
        Err(Error::Oom(OomError {
            source,
            requested_bytes: n(d[2]),
            capacity_bytes: capacity,
            free_bytes: n(d[3]),
            phase: n(d[0]).and_then(|p| Phase::ALL.get(p as usize).copied()),
            micro_batch: n(d[1]).map(|m| m as usize),
            message: own_message.unwrap_or_else(|| source.said_by_peer(r)),
        }))
    }
}

/// LOCAL_WORLD_SIZE (else WORLD_SIZE) in a data-parallel run: the ranks on this node.
pub fn local_world() -> Option<usize> {
    let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok());
    num("LOCAL_WORLD_SIZE").or_else(|| num("WORLD_SIZE")).filter(|&w| w > 1)
}

/// LOCAL_RANK in a data-parallel run (WORLD_SIZE above 1), before the group forms.
pub fn local_rank() -> Result<Option<usize>> {
    let world = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.trim().parse::<usize>().ok())
        .unwrap_or(1);
    match (world > 1)
        .then(|| std::env::var("LOCAL_RANK").or_else(|_| std::env::var("RANK")))
        .transpose()
    {
        Ok(None) | Err(_) => Ok(None),
        Ok(Some(v)) => v.trim().parse().map(Some).map_err(|_| {
            ConfigError {
                origin: "environment".into(),
                line_col: None,
                key: "LOCAL_RANK".into(),
                message: format!("`{v}` is not a whole number"),
            }
            .into()
        }),
    }
}

/// Rank `rank`'s contiguous part of `global` samples over `world` ranks, as even as can be
/// (the first `global % world` ranks take one more). Together they cover 0..global once.
pub fn shard(global: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (global / world, global % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The gradients of the reduction after backward: small ones moved into buckets of at most
/// `bucket_bytes` (few collectives instead of many), their parameters' gradients then views
/// of them, as DDP's `gradient_as_bucket_view` (no second copy held); large ones reduced in
/// place. All in flight at once.
pub struct Buckets {
    /// What is summed: the buckets, then the large gradients.
    parts: Vec<Tensor>,
}

/// The address Gloo's sockets bind to (empty: `GLOO_SOCKET_IFNAME` names an interface):
/// this host's own on the route to MASTER_ADDR, as the exchange's listener. Gloo's default,
/// the hostname's address, is loopback on many hosts (`/etc/hosts`), where ranks on other
/// nodes cannot reach it.
fn gloo_host(master: &str) -> Result<String> {
    if std::env::var_os("GLOO_SOCKET_IFNAME").is_some() {
        return Ok(String::new());
    }
    exchange::local_ip_towards(master)
        .map(|ip| ip.to_string())
        .map_err(|e| Error::Dist(format!("no route to MASTER_ADDR {master} for Gloo's sockets: {e}; set GLOO_SOCKET_IFNAME to the interface to use")))
}

/// Gradients of at least this size are reduced in place, not copied into a bucket.
const SOLO_BYTES: usize = 1 << 20;

impl Buckets {
    /// Moves the small gradients of `params` into buckets, one bucket at a time (its bytes
    /// more, for a moment): this allocates, so it runs before the ranks agree. A failure
    /// leaves every gradient's values as they were.
    pub fn pack(params: &[Tensor], bucket_bytes: usize) -> Result<Buckets, TchError> {
        let (mut members, mut solo): (Vec<Vec<usize>>, Vec<Tensor>) = (vec![], vec![]);
        let mut size = usize::MAX;
        for (i, p) in params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            let bytes = g.numel() * g.kind().elt_size_in_bytes();
            if bytes >= SOLO_BYTES {
                solo.push(g);
                continue;
            }
            if size.saturating_add(bytes) > bucket_bytes
                || members.last().is_some_and(|m| params[m[0]].kind() != p.kind())
            {
                members.push(vec![]);
                size = 0;
            }
            if let Some(m) = members.last_mut() {
                m.push(i);
            }
            size += bytes;
        }
        let mut parts = Vec::with_capacity(members.len() + solo.len());
        for m in &members {
            let flat = Tensor::f_cat(
                &m.iter()
                    .map(|&i| params[i].grad().f_reshape([-1]))
                    .collect::<Result<Vec<_>, _>>()?,
                0,
            )?;
            let mut at = 0;
            for &i in m {
                let n = params[i].numel() as i64;
                crate::memory::set_grad(&params[i], &flat.f_narrow(0, at, n)?.f_view_as(&params[i])?);
                at += n;
            }
            parts.push(flat);
        }
        parts.extend(solo);
        Ok(Buckets { parts })
    }

    /// Sums over the ranks, in place: the gradients hold the sums.
    pub fn reduce(&self, pg: &ProcessGroup) -> Result<()> {
        pg.all_reduce(&self.parts, Op::Sum)
    }

    /// What holds this rank's gradients until the reduce.
    pub fn parts(&self) -> &[Tensor] {
        &self.parts
    }

    /// Collectives per step.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An all-gather in flight (`ProcessGroup::all_gather_start`). Dropped unwaited (the step
/// has failed already), it is let go: its tensors stay the backend's until it ends.
pub struct Gathering(*mut c_void);

impl crate::optim::InFlight for Gathering {
    fn wait(mut self: Box<Self>) -> Result<()> {
        let started = std::mem::replace(&mut self.0, std::ptr::null_mut());
        check(unsafe { og_dist_gathered(started, 1) }).map_err(dist_error("all-gather"))
    }
}

impl Drop for Gathering {
    fn drop(&mut self) {
        if !self.0.is_null() {
            let _ = check(unsafe { og_dist_gathered(self.0, 0) });
        }
    }
}

impl crate::optim::Comm for ProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        self.all_reduce(std::slice::from_ref(t), Op::Sum)
    }
    fn all_reduce_max(&self, t: &Tensor) -> Result<()> {
        self.all_reduce(std::slice::from_ref(t), Op::Max)
    }
    fn reduce_scatter(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        ProcessGroup::reduce_scatter(self, input, out)
    }
    fn all_gather_start(&self, input: &Tensor, out: &Tensor) -> Result<Box<dyn crate::optim::InFlight>> {
        Ok(Box::new(ProcessGroup::all_gather_start(self, input, out)?))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        ProcessGroup::broadcast(self, std::slice::from_ref(t), root)
    }
}

impl crate::guard::Agree for ProcessGroup {
    fn max(&self, values: &mut [f64]) -> Result<()> {
        self.exchange(Topic::GuardInputs, values)
    }
}

/// torchrun's variables, checked before the group forms: a bad one is exit 2 naming it.
fn check_env(rank: usize, world: usize, local_rank: usize, local_world: Option<usize>, port: usize) -> Result<()> {
    let bad = |key: &str, message: String| {
        Err(ConfigError {
            origin: "environment".into(),
            line_col: None,
            key: key.into(),
            message,
        }
        .into())
    };
    if rank >= world {
        return bad(
            "RANK",
            format!("{rank} is not below WORLD_SIZE {world}: ranks are 0..{}", world - 1),
        );
    }
    if let Some(lw) = local_world.filter(|&lw| local_rank >= lw) {
        return bad("LOCAL_RANK", format!("{local_rank} is not below LOCAL_WORLD_SIZE {lw}"));
    }
    if !(1..=65535).contains(&port) {
        return bad("MASTER_PORT", format!("{port} is not a TCP port (1-65535)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_env, shard};

    #[test]
    fn phases_round_trip_through_an_agreement() {
        for (i, p) in crate::error::Phase::ALL.iter().enumerate() {
            assert_eq!(*p as u8 as usize, i);
        }
    }

    #[test]
    fn torchrun_variables_out_of_range_are_refused() {
        assert!(check_env(1, 2, 1, Some(2), 29500).is_ok());
        let e = check_env(2, 2, 0, None, 29500).unwrap_err().to_string();
        assert!(e.contains("RANK") && e.contains("2 is not below WORLD_SIZE 2"), "{e}");
        assert!(check_env(0, 2, 2, Some(2), 29500)
            .unwrap_err()
            .to_string()
            .contains("LOCAL_RANK"));
        let e = check_env(0, 2, 0, None, 70000).unwrap_err().to_string();
        assert!(
            e.contains("MASTER_PORT") && e.contains("70000 is not a TCP port"),
            "{e}"
        );
        assert!(check_env(0, 2, 0, None, 0).is_err());
    }

    #[test]
    fn shards_cover_the_global_batch_once() {
        for (global, world) in [(16, 2), (17, 2), (5, 3), (3, 4), (64, 8)] {
            let parts: Vec<_> = (0..world).map(|r| shard(global, world, r)).collect();
            assert_eq!(parts.first().unwrap().start, 0);
            assert_eq!(parts.last().unwrap().end, global);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start), "{parts:?}");
            let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
        }
    }
}
