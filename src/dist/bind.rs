//! Owns binding data-parallel CPU ranks to cores: rank R of N takes the R-th share of the mask.
//! Keeps: shares never overlap; `OOMGUARD_CPU_BIND=0` leaves the mask alone.

/// Rank `local_rank`'s share of `cpus` over `local_world` ranks: contiguous, as even as can
/// be; `None` when there are fewer cores than ranks (nothing to split).
pub fn share(cpus: &[usize], local_rank: usize, local_world: usize) -> Option<Vec<usize>> {
    if local_world < 2 || cpus.len() < local_world || local_rank >= local_world {
        return None;
    }
    Some(cpus[crate::dist::shard(cpus.len(), local_world, local_rank)].to_vec())
}

/// Binds this process to its share of its affinity mask; returns the cores it now has.
pub fn bind_rank(local_rank: usize, local_world: usize) -> Option<Vec<usize>> {
    if std::env::var("OOMGUARD_CPU_BIND").is_ok_and(|v| v == "0") {
        return None;
    }
    // SAFETY: a zeroed cpu_set_t is valid; the calls write at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect();
        let mine = share(&cpus, local_rank, local_world)?;
        let mut new: libc::cpu_set_t = std::mem::zeroed();
        for &c in &mine {
            libc::CPU_SET(c, &mut new);
        }
        (libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &new) == 0).then_some(mine)
    }
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn ranks_get_disjoint_contiguous_shares() {
        let cpus: Vec<usize> = (0..8).collect();
        assert_eq!(share(&cpus, 0, 2), Some(vec![0, 1, 2, 3]));
        assert_eq!(share(&cpus, 1, 2), Some(vec![4, 5, 6, 7]));
        assert_eq!(share(&cpus, 2, 3), Some(vec![6, 7]));
        assert_eq!(share(&[0, 1], 1, 2), Some(vec![1]));
        // Fewer cores than ranks, or one rank: left alone.
        assert_eq!(share(&[0, 1], 0, 3), None);
        assert_eq!(share(&cpus, 0, 1), None);
    }
}
