//! What a run cost the server: CPU time (the whole process, and its shard threads apart)
//! and bytes written to disk, read from Linux's `/proc` before and after the measured
//! window. These are steadier than throughput on a noisy machine and show where the cost
//! is.

use std::path::Path;

/// Clock ticks per second of `/proc/*/stat` times (`USER_HZ`), 100 on every Linux
/// architecture this runs on.
pub const TICKS_PER_S: f64 = 100.0;

/// A process to measure: its threads, and optionally its children (PostgreSQL serves
/// each connection from a child process).
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The process.
    pub pid: u32,
    /// Whether its child processes count too.
    pub with_children: bool,
    /// The block device (major, minor) whose own count of bytes written is read too
    /// (see [`Probe::on_device_of`]).
    pub device: Option<(u64, u64)>,
}

/// One reading.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    /// CPU ticks of every thread.
    pub cpu_ticks: u64,
    /// CPU ticks of the engine's shard threads (`oncegate-shard-*`).
    pub shard_cpu_ticks: u64,
    /// Bytes the process caused to be written to storage (`write_bytes`).
    pub write_bytes: u64,
    /// Bytes the block device wrote (every process's, the file system's journal too).
    pub device_bytes: u64,
}

/// What a window cost, per pair.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Cost {
    /// CPU time of the server process per pair, in microseconds.
    pub cpu_us_per_pair: f64,
    /// CPU time of the shard threads per command, in microseconds.
    pub shard_cpu_us_per_command: f64,
    /// CPU time of every other thread of the server per command, in microseconds: for a
    /// server that the tool calls, what one call costs it between the socket and the
    /// shard and back (the front path's own figure). A duplicate answered from its stored
    /// response is one command, a pair two, so this is not half the CPU per pair.
    pub front_cpu_us_per_command: f64,
    /// Bytes written to disk per pair, as the kernel counts them against the process
    /// (`write_bytes`: pages as they are dirtied).
    pub disk_bytes_per_pair: f64,
    /// Bytes the block device wrote per pair: what reached the disk, the file system's
    /// journal included (and anything else written meanwhile). `write_bytes` counts a
    /// page each time a write dirties it again, which overcounts a file overwritten in
    /// place many times over; the device does not.
    pub device_bytes_per_pair: f64,
}

impl Probe {
    /// This process (the embedded target).
    pub fn this_process() -> Probe {
        Probe::of(std::process::id())
    }

    /// A process, without its children.
    pub fn of(pid: u32) -> Probe {
        Probe { pid, with_children: false, device: None }
    }

    /// Reads, beside the process, the block device that holds `dir`.
    pub fn on_device_of(self, dir: &Path) -> Probe {
        use std::os::unix::fs::MetadataExt;
        let device = std::fs::metadata(dir).ok().map(|meta| {
            let dev = meta.dev();
            ((dev >> 8) & 0xfff, (dev & 0xff) | ((dev >> 12) & 0xfff00))
        });
        Probe { device, ..self }
    }

    /// Reads the process (and its children) now.
    pub fn sample(&self) -> Sample {
        let mut sample = read_process(self.pid);
        if self.with_children {
            // Children it has reaped keep their time in its own `stat`; the live ones
            // are read each.
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
            sample.cpu_ticks += reaped_children_ticks(&stat).unwrap_or(0);
            for child in children(self.pid) {
                let more = read_process(child);
                sample.cpu_ticks += more.cpu_ticks;
                sample.write_bytes += more.write_bytes;
            }
        }
        if let Some((major, minor)) = self.device {
            sample.device_bytes = device_written_bytes(major, minor);
        }
        sample
    }
}

impl Sample {
    /// The cost of the window from `self` to `after`, for `pairs` pairs made of
    /// `commands` engine commands.
    pub fn cost_to(&self, after: &Sample, pairs: u64, commands: u64) -> Cost {
        let per = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let us = |ticks: u64| ticks as f64 / TICKS_PER_S * 1e6;
        // Saturating: a sum over live threads or children drops one that ended in the
        // window, and can then go down.
        let cpu = after.cpu_ticks.saturating_sub(self.cpu_ticks);
        let shard_cpu = after.shard_cpu_ticks.saturating_sub(self.shard_cpu_ticks);
        let per_command = |ticks: u64| us(ticks) / commands.max(1) as f64;
        Cost {
            cpu_us_per_pair: us(cpu) / pairs.max(1) as f64,
            shard_cpu_us_per_command: per_command(shard_cpu),
            front_cpu_us_per_command: per_command(cpu.saturating_sub(shard_cpu)),
            disk_bytes_per_pair: per(after.write_bytes.saturating_sub(self.write_bytes), pairs),
            device_bytes_per_pair: per(after.device_bytes.saturating_sub(self.device_bytes), pairs),
        }
    }
}

/// The process's CPU from its own `stat` (which keeps the time of threads that have
/// exited; a sum over `task/` would drop it), and its shard threads' from theirs.
fn read_process(pid: u32) -> Sample {
    let mut sample = Sample::default();
    let process = Path::new("/proc").join(pid.to_string());
    let stat = std::fs::read_to_string(process.join("stat")).ok();
    sample.cpu_ticks = stat.and_then(|s| cpu_ticks(&s)).map_or(0, |(_, ticks)| ticks);
    for task in std::fs::read_dir(process.join("task")).into_iter().flatten().flatten() {
        let Some((comm, ticks)) =
            std::fs::read_to_string(task.path().join("stat")).ok().and_then(|s| cpu_ticks(&s))
        else {
            continue;
        };
        if comm.starts_with("oncegate-shard") {
            sample.shard_cpu_ticks += ticks;
        }
    }
    sample.write_bytes = write_bytes(&format!("/proc/{pid}/io"));
    sample
}

/// CPU ticks of the calling thread.
pub fn this_thread_ticks() -> u64 {
    std::fs::read_to_string("/proc/thread-self/stat").ok().and_then(|s| cpu_ticks(&s)).map_or(0, |(_, t)| t)
}

/// CPU time of the calling thread, to the nanosecond (`CLOCK_THREAD_CPUTIME_ID`).
pub fn this_thread_cpu() -> std::time::Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(u64::try_from(now.tv_sec).unwrap_or(0), u32::try_from(now.tv_nsec).unwrap_or(0))
}

/// Bytes this process caused to be written to storage.
pub fn this_process_write_bytes() -> u64 {
    write_bytes("/proc/self/io")
}

/// `write_bytes` of an `io` file.
fn write_bytes(path: &str) -> u64 {
    let io = std::fs::read_to_string(path).unwrap_or_default();
    io.lines().find_map(|l| l.strip_prefix("write_bytes:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// The command name and `utime + stime` of a `stat` line. The name is in parentheses
/// and may hold spaces, so the fields are counted after the last `)`.
fn cpu_ticks(stat: &str) -> Option<(String, u64)> {
    let (head, tail) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = tail.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// `cutime + cstime` of a `stat` line: the CPU of the children the process has reaped.
fn reaped_children_ticks(stat: &str) -> Option<u64> {
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let cutime: u64 = fields.get(13)?.parse().ok()?;
    let cstime: u64 = fields.get(14)?.parse().ok()?;
    Some(cutime + cstime)
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let parent =
            stat.rsplit_once(')').and_then(|(_, tail)| tail.split_whitespace().nth(1)?.parse::<u32>().ok());
        if parent == Some(pid) {
            found.push(child);
        }
    }
    found
}

/// The resident set size of a process, in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .map_or(0, |kib: u64| kib * 1024)
}

/// Bytes a block device has written since boot (sectors written, the seventh field of
/// its `stat`, in 512-byte sectors whatever the device's own sector size).
pub fn device_written_bytes(major: u64, minor: u64) -> u64 {
    std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat"))
        .ok()
        .and_then(|stat| stat.split_whitespace().nth(6)?.parse::<u64>().ok())
        .map_or(0, |sectors| sectors * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_spaces_in_the_name_parse() {
        let line = "42 (oncegate-shard 1) S 1 42 42 0 -1 4194368 10 0 0 0 150 25 0 0 20 0 1 0 100 0 0";
        assert_eq!(cpu_ticks(line), Some(("oncegate-shard 1".to_owned(), 175)));
        assert_eq!(reaped_children_ticks(line), Some(0));
        let parent = "7 (postgres) S 1 7 7 0 -1 4194368 10 0 0 0 150 25 40 2 20 0 1 0 100 0 0";
        assert_eq!(reaped_children_ticks(parent), Some(42));
    }

    #[test]
    fn the_front_path_is_the_cpu_outside_the_shards_per_command() {
        let before = Sample { cpu_ticks: 100, shard_cpu_ticks: 40, ..Sample::default() };
        let after = Sample { cpu_ticks: 290, shard_cpu_ticks: 80, ..Sample::default() };
        // 100 pairs, 10 of them duplicates answered with one command: 190 commands.
        let cost = before.cost_to(&after, 100, 190);
        assert_eq!(cost.cpu_us_per_pair, 19_000.0);
        assert_eq!(cost.shard_cpu_us_per_command, 400_000.0 / 190.0);
        assert_eq!(cost.front_cpu_us_per_command, 1_500_000.0 / 190.0);
    }
}
