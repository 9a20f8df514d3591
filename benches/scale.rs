//! `cargo bench --bench scale`: what the control plane and ZeRO's layout cost per rank as the
//! world grows, simulated on this machine (threads of one process, loopback only). One line each:
//! - `exchange ranks=N bytes_per_rank=B p50_us=T` (N in 8 64 256): one agreement round of the
//!   ranks' exchange (a tree: src/dist/exchange.rs); B is the busiest rank's bytes sent and
//!   received a round, T the median round on rank 0;
//! - `# exchange_gloo ranks=N p50_us=T` (N in 8 64): the same round as one MAX all-reduce on
//!   c10d's Gloo group of the same ranks, the alternative (docs/data-parallel.md: why the tree);
//! - `zero_pack world=N params=P host_ms=T` (N in 8 64 512, P = GPT-2 124M): one rank's per-step
//!   layout work, packing every chunk's buffer and unpacking it back, no collectives (median of
//!   5), after `# zero_plan world=N chunks=C blocks=B`, the plan's copies a step.
//!
//! Lines starting with `#` are context, not the figures.
//!
//! Floors (issue #41): bytes per rank at 256 at most 2x that at 8; the exchange at 256 ranks at
//! most 20 ms at the median; ZeRO host work at world 512 at most 1.5x that at world 8.
use std::sync::Arc;
use std::time::{Duration, Instant};

use oomguard::dist::exchange::{Channel, Exchange, MemoryStore, Topic};
use oomguard::dist::{Op, ProcessGroup, Rendezvous};
use oomguard::optim::zero::{Layout, BUCKET_BYTES};
use tch::{Device, Kind, Tensor};

const ROUNDS: usize = 200;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `world` ranks on threads, each timing `ROUNDS` rounds of `round`; rank 0's median round
/// (µs) and the busiest rank's bytes a round.
fn simulate<S: 'static>(
    world: usize,
    setup: impl Fn(usize) -> S + Send + Sync + 'static,
    round: impl Fn(&S) + Send + Sync + 'static,
    bytes: impl Fn(&S) -> u64 + Send + Sync + 'static,
) -> (f64, u64) {
    let (setup, round, bytes) = (Arc::new(setup), Arc::new(round), Arc::new(bytes));
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let (setup, round, bytes) = (setup.clone(), round.clone(), bytes.clone());
            std::thread::spawn(move || {
                let s = setup(r);
                for _ in 0..10 {
                    round(&s); // warm-up
                }
                let before = bytes(&s);
                let mut times = Vec::with_capacity(ROUNDS);
                for _ in 0..ROUNDS {
                    let t = Instant::now();
                    round(&s);
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
                (median(times), (bytes(&s) - before) / ROUNDS as u64)
            })
        })
        .collect();
    let got: Vec<(f64, u64)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    (got[0].0, got.iter().map(|g| g.1).max().unwrap_or(0))
}

/// An agreement's payload: the lowest rank with an OOM and with another error (none here).
fn agreement(x: &Exchange) {
    let mut v = [f64::NEG_INFINITY; 2];
    x.run(Topic::Agreement, &mut v).unwrap();
}

fn exchange(world: usize) -> (f64, u64) {
    let store = MemoryStore::default();
    simulate(
        world,
        move |r| {
            let s = store.clone();
            let ch = Channel::open(r, world, "127.0.0.1", "bench", Duration::from_secs(120), move |k, v| {
                s.share(k, v)
            });
            Exchange::new(ch.unwrap(), 16)
        },
        agreement,
        Exchange::bytes_moved,
    )
}

/// A port nothing listens on now (the store's, rank 0 binds it).
fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn gloo(world: usize) -> f64 {
    let port = free_port();
    let (p50, _) = simulate(
        world,
        move |rank| {
            let at = Rendezvous {
                rank,
                world,
                local_rank: rank,
                addr: "127.0.0.1".into(),
                port,
                token: "bench".into(),
                timeout: Duration::from_secs(300),
                shared_memory: false,
            };
            let pg = ProcessGroup::join(&at, Device::Cpu).unwrap();
            // The exchange's message: a 6-value header and a 16-value payload.
            let t = Tensor::zeros([22], (Kind::Double, Device::Cpu));
            (pg, t)
        },
        |(pg, t)| pg.all_reduce(std::slice::from_ref(t), Op::Max).unwrap(),
        |_| 0,
    );
    p50
}

fn zero_pack(world: usize, numels: &[i64], grads: &[Tensor], params: &[Tensor]) -> f64 {
    let layout = Layout::new(numels, 0, world, BUCKET_BYTES / 4);
    println!(
        "# zero_plan world={world} chunks={} blocks={}",
        layout.chunks().len(),
        layout.blocks()
    );
    let buf = Tensor::zeros([world as i64 * layout.chunk], (Kind::Float, Device::Cpu));
    let step = || {
        let t = Instant::now();
        for c in layout.chunks() {
            let b = buf.narrow(0, 0, world as i64 * c.1);
            layout.pack_all(grads, c, &b).unwrap();
            layout.unpack_all(&b, c, params).unwrap();
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    step();
    median((0..5).map(|_| step()).collect())
}

fn main() {
    tch::set_num_threads(1);
    for n in [8, 64, 256] {
        let (p50, bytes) = exchange(n);
        println!("exchange ranks={n} bytes_per_rank={bytes} p50_us={p50:.0}");
    }
    for n in [8, 64] {
        println!("# exchange_gloo ranks={n} p50_us={:.0}", gloo(n));
    }
    let numels = oomguard::dist::cost::gpt2_124m();
    let total: i64 = numels.iter().sum();
    let make = |x: f64| -> Vec<Tensor> {
        numels
            .iter()
            .map(|&n| Tensor::full([n], x, (Kind::Float, Device::Cpu)))
            .collect()
    };
    let (grads, params) = (make(1.0), make(0.0));
    for n in [8, 64, 512] {
        println!(
            "zero_pack world={n} params={total} host_ms={:.1}",
            zero_pack(n, &numels, &grads, &params)
        );
    }
}
