//! Readings of this process (Linux `/proc`): CPU time per thread, resident memory, and the
//! counters a component exposes on its metrics page.
//!
//! Every component of a [`super::cluster::Cluster`] runs on threads named after it
//! (`sidecar-N`, `proxy`), so CPU time read per thread is CPU time per component.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;

/// CPU time of every thread of this process at one moment: thread id -> (name, nanoseconds on
/// a CPU, nanoseconds runnable but waiting for one).
#[derive(Debug, Clone, Default)]
pub struct CpuSample(HashMap<u64, (String, [u64; 2])>);

/// Time some threads spent, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuTime {
    pub on_cpu_s: f64,
    /// Runnable but waiting for a CPU (0 where the kernel does not say).
    pub waiting_s: f64,
}

impl CpuSample {
    pub fn now() -> anyhow::Result<Self> {
        let mut threads = HashMap::new();
        let dir = std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")?;
        for entry in dir {
            let entry = entry.context("listing /proc/self/task")?;
            let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            // A thread may end while it is read: it is left out.
            let path = entry.path();
            let Ok(name) = std::fs::read_to_string(path.join("comm")) else {
                continue;
            };
            let ns = match std::fs::read_to_string(path.join("schedstat")) {
                Ok(s) => schedstat_ns(&s),
                // Without schedstat, the clock-tick counts of stat (at the usual 100 a second).
                Err(_) => std::fs::read_to_string(path.join("stat"))
                    .ok()
                    .and_then(|s| stat_ticks(&s))
                    .map(|t| [t * 10_000_000, 0]),
            };
            if let Some(ns) = ns {
                threads.insert(tid, (name.trim().to_string(), ns));
            }
        }
        anyhow::ensure!(!threads.is_empty(), "no thread CPU time in /proc/self/task");
        Ok(Self(threads))
    }

    /// The time spent since `before`, summed by thread name (a thread started since counts
    /// whole; one that ended since is lost).
    pub fn since(&self, before: &CpuSample) -> BTreeMap<String, CpuTime> {
        let mut by_name: BTreeMap<String, CpuTime> = BTreeMap::new();
        for (tid, (name, [run, wait])) in &self.0 {
            let [run_was, wait_was] = before.0.get(tid).map_or([0, 0], |(_, ns)| *ns);
            let t = by_name.entry(name.clone()).or_default();
            t.on_cpu_s += run.saturating_sub(run_was) as f64 / 1e9;
            t.waiting_s += wait.saturating_sub(wait_was) as f64 / 1e9;
        }
        by_name
    }
}

/// Nanoseconds on a CPU and waiting for one, from a `/proc/.../schedstat` line (its first two
/// fields).
pub fn schedstat_ns(line: &str) -> Option<[u64; 2]> {
    let mut f = line.split_whitespace().map(str::parse);
    Some([f.next()?.ok()?, f.next()?.ok()?])
}

/// The one-minute load average of the machine.
pub fn load_average() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").context("reading /proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .with_context(|| format!("no load average in /proc/loadavg: {text:?}"))
}

/// utime + stime, in clock ticks, from a `/proc/.../stat` line (the thread name may hold spaces
/// and parentheses, so fields are counted from the last `)`).
pub fn stat_ticks(line: &str) -> Option<u64> {
    let rest = &line[line.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After the name: state is field 3, utime 14 and stime 15.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Resident bytes of this process.
pub fn rss_bytes() -> anyhow::Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    vm_rss_bytes(&status).context("no VmRSS in /proc/self/status")
}

/// Bytes this process's allocator has handed out and not taken back (glibc's `mallinfo2`: the
/// small blocks in use and the mapped large ones), or `None` without glibc. Unlike the resident
/// set, it does not count memory freed but kept, so it follows allocations closely.
pub fn heap_in_use() -> Option<u64> {
    heap::in_use()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod heap {
    /// glibc's `struct mallinfo2` (glibc 2.33 and later).
    #[repr(C)]
    #[allow(dead_code)]
    struct MallInfo2 {
        arena: usize,
        ordblks: usize,
        smblks: usize,
        hblks: usize,
        hblkhd: usize,
        usmblks: usize,
        fsmblks: usize,
        uordblks: usize,
        fordblks: usize,
        keepcost: usize,
    }

    extern "C" {
        fn mallinfo2() -> MallInfo2;
    }

    pub fn in_use() -> Option<u64> {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct by value; it only
        // reads the allocator's own counters under its locks.
        let m = unsafe { mallinfo2() };
        Some((m.uordblks + m.hblkhd) as u64)
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod heap {
    pub fn in_use() -> Option<u64> {
        None
    }
}

/// The `VmRSS` of a `/proc/.../status` text, in bytes.
pub fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut f = line["VmRSS:".len()..].split_whitespace();
    let n: u64 = f.next()?.parse().ok()?;
    match f.next() {
        Some("kB") => Some(n * 1024),
        _ => None,
    }
}

/// The sum of the samples of counter `name` whose labels include every one of `labels`, in a
/// Prometheus text exposition; 0 when none does.
pub fn counter(text: &str, name: &str, labels: &[(&str, &str)]) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (label_text, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once('}')?,
                None if rest.starts_with(' ') => ("", rest),
                None => return None,
            };
            let held = labels
                .iter()
                .all(|(k, v)| label_text.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            let value: f64 = value.split_whitespace().next()?.parse().ok()?;
            held.then_some(value as u64)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_reads_from_schedstat_and_stat() {
        assert_eq!(
            schedstat_ns("123456789 5000 42\n"),
            Some([123_456_789, 5000])
        );
        assert_eq!(schedstat_ns("12"), None);
        let stat = "4242 (sidecar-1 (x)) S 1 2 3 4 5 6 7 8 9 10 31 17 0 0 20 0 1 0";
        assert_eq!(stat_ticks(stat), Some(48));
        assert_eq!(stat_ticks("4242 (short) S 1"), None);
    }

    #[test]
    fn a_thread_counts_from_its_first_sample_or_from_its_start() {
        let before = CpuSample(HashMap::from([
            (1, ("sidecar-1".into(), [1_000_000_000, 0])),
            (2, ("proxy".into(), [0, 0])),
        ]));
        let after = CpuSample(HashMap::from([
            (1, ("sidecar-1".into(), [3_000_000_000, 500_000_000])),
            (2, ("proxy".into(), [500_000_000, 0])),
            (3, ("sidecar-1".into(), [250_000_000, 0])),
        ]));
        let spent = after.since(&before);
        let t = |on_cpu_s, waiting_s| CpuTime {
            on_cpu_s,
            waiting_s,
        };
        assert_eq!(spent["sidecar-1"], t(2.25, 0.5));
        assert_eq!(spent["proxy"], t(0.5, 0.0));
    }

    #[test]
    fn the_heap_in_use_grows_with_an_allocation() {
        let Some(before) = heap_in_use() else { return };
        let block = std::hint::black_box(vec![1u8; 4 << 20]);
        let after = heap_in_use().unwrap();
        // Other tests allocate and free meanwhile: a margin for them.
        assert!(after >= before + (3 << 20), "{before} -> {after}");
        drop(block);
    }

    #[test]
    fn resident_memory_reads_in_bytes() {
        let status = "Name:\tcellmesh\nVmHWM:\t  9000 kB\nVmRSS:\t  8192 kB\nThreads: 9\n";
        assert_eq!(vm_rss_bytes(status), Some(8192 * 1024));
        assert_eq!(vm_rss_bytes("Name: x\n"), None);
    }

    #[test]
    fn counters_sum_over_the_labels_not_named() {
        let text = "# HELP x_bytes Bytes.\n# TYPE x_bytes counter\n\
            x_bytes_total{direction=\"out\",peer=\"sidecar\"} 100\n\
            x_bytes_total{direction=\"out\",peer=\"proxy\"} 20\n\
            x_bytes_total{direction=\"in\",peer=\"sidecar\"} 7\n\
            x_bytes_total_other{direction=\"out\"} 1000\n\
            x_ticks_total 5\n";
        let out = [("direction", "out")];
        assert_eq!(counter(text, "x_bytes_total", &out), 120);
        let to_peers = [("direction", "out"), ("peer", "sidecar")];
        assert_eq!(counter(text, "x_bytes_total", &to_peers), 100);
        assert_eq!(counter(text, "x_ticks_total", &[]), 5);
        assert_eq!(counter(text, "x_frames_total", &[]), 0);
    }
}
