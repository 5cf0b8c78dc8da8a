//! The kernel's own round-trip estimate of a client's TCP connection (Linux `TCP_INFO`).
//!
//! The kernel times its segments against the ACKs the client's *kernel* sends back, so a game
//! client that delays its pongs does not move it: where a connection is TCP, this is the figure
//! placement and handover use, and the proxy's timed pings are kept for display.

use std::os::fd::AsRawFd;

/// The kernel's figures for one connection, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelRtt {
    /// The lowest RTT seen on the connection (Linux 4.6 and later; 0 where unknown).
    pub min_ms: f64,
    /// The smoothed RTT (srtt).
    pub smoothed_ms: f64,
}

/// The kernel's RTT figures for `socket`, or `None` where the kernel gives none (another OS, or
/// a connection too young to have a sample).
#[cfg(target_os = "linux")]
pub(crate) fn kernel_rtt(socket: &impl AsRawFd) -> Option<KernelRtt> {
    // SAFETY: `tcp_info` is plain old data, and getsockopt writes at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 || info.tcpi_rtt == 0 {
        return None;
    }
    // An older kernel fills a shorter struct and leaves the minimum out.
    let has_min = len as usize
        >= std::mem::offset_of!(libc::tcp_info, tcpi_min_rtt) + std::mem::size_of::<u32>();
    let min_us = if has_min && info.tcpi_min_rtt > 0 {
        info.tcpi_min_rtt
    } else {
        info.tcpi_rtt
    };
    Some(KernelRtt {
        min_ms: f64::from(min_us) / 1000.0,
        smoothed_ms: f64::from(info.tcpi_rtt) / 1000.0,
    })
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn kernel_rtt(_socket: &impl AsRawFd) -> Option<KernelRtt> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_loopback_connection_has_a_small_kernel_rtt_once_data_flowed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut buf = [0u8; 4];
            for _ in 0..5 {
                c.read_exact(&mut buf).await.unwrap();
                c.write_all(&buf).await.unwrap();
            }
        });
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4];
        for _ in 0..5 {
            s.write_all(b"ping").await.unwrap();
            s.read_exact(&mut buf).await.unwrap();
        }
        client.await.unwrap();
        let k = kernel_rtt(&s).expect("linux gives TCP_INFO");
        assert!(k.min_ms > 0.0 && k.min_ms <= k.smoothed_ms.max(k.min_ms));
        assert!(k.smoothed_ms < 50.0, "loopback: {k:?}");
    }
}
