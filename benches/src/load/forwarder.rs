//! The baseline every latency is measured against: minimal framed TCP forwarders (a length
//! prefix, read a frame, write it on), chained in this process or as processes of their own,
//! and a paced source and a sink that measures what arrives.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use super::game::{now_ns, read_stamp, stamped};
use super::report::nanos_histogram;

/// How a forwarder process starts its one line on stdout: `… ADDR`.
pub const FORWARDER_LISTENING: &str = "cellmesh forwarder listening";

/// Forwards the frames of every connection accepted on `listener` to a connection of its own to
/// `to`, until the listener fails.
pub async fn serve(listener: TcpListener, to: SocketAddr) -> std::io::Result<()> {
    loop {
        let (inbound, _) = listener.accept().await?;
        tokio::spawn(async move {
            if let Err(e) = forward(inbound, to).await {
                tracing::debug!(error = %e, "forwarder connection ended");
            }
        });
    }
}

async fn forward(inbound: TcpStream, to: SocketAddr) -> std::io::Result<()> {
    let outbound = TcpStream::connect(to).await?;
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let mut rd = FramedRead::new(inbound, LengthDelimitedCodec::new());
    let mut wr = FramedWrite::new(outbound, LengthDelimitedCodec::new());
    while let Some(frame) = rd.next().await {
        wr.send(frame?.freeze()).await?;
    }
    Ok(())
}

/// `hops` forwarders in this process, the last forwarding to `sink`: the address of the first.
pub async fn chain_in_process(
    hops: usize,
    sink: SocketAddr,
) -> std::io::Result<(SocketAddr, Vec<JoinHandle<std::io::Result<()>>>)> {
    let mut next = sink;
    let mut tasks = Vec::new();
    for _ in 0..hops {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tasks.push(tokio::spawn(serve(l, next)));
        next = addr;
    }
    Ok((next, tasks))
}

/// `hops` forwarder processes (`exe forwarder --to ADDR`), the last forwarding to `sink`: the
/// address of the first. The children are killed when dropped.
pub async fn chain_as_processes(
    exe: &Path,
    hops: usize,
    sink: SocketAddr,
) -> anyhow::Result<(SocketAddr, Vec<Child>)> {
    let mut next = sink;
    let mut children = Vec::new();
    for _ in 0..hops {
        let mut child = Command::new(exe)
            .args(["forwarder", "--to", &next.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} forwarder", exe.display()))?;
        let stdout = child.stdout.take().context("forwarder stdout")?;
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await
        .context("the forwarder did not report its address within 10 s")??;
        next = line
            .trim()
            .strip_prefix(FORWARDER_LISTENING)
            .map(str::trim)
            .with_context(|| format!("the forwarder said {line:?}"))?
            .parse()
            .with_context(|| format!("the forwarder said {line:?}"))?;
        children.push(child);
    }
    Ok((next, children))
}

/// The body of `cellmesh forwarder --to ADDR`: binds a loopback port, says so on stdout, and
/// forwards to `to` until killed.
pub async fn run_process(to: SocketAddr) -> anyhow::Result<()> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    println!("{FORWARDER_LISTENING} {}", l.local_addr()?);
    serve(l, to).await.context("forwarding")
}

/// A sink: accepts one connection and records the latency of every stamped frame sent from
/// `measure_from_ns` on, until `stop`.
pub async fn sink(
    listener: TcpListener,
    measure_from_ns: u64,
    stop: CancellationToken,
) -> anyhow::Result<Histogram<u64>> {
    let mut h = nanos_histogram();
    let (conn, _) = tokio::select! {
        c = listener.accept() => c?,
        _ = stop.cancelled() => anyhow::bail!("nothing connected to the sink"),
    };
    conn.set_nodelay(true)?;
    let mut rd = FramedRead::new(conn, LengthDelimitedCodec::new());
    loop {
        let frame = tokio::select! {
            f = rd.next() => f,
            _ = stop.cancelled() => break,
        };
        let Some(frame) = frame else { break };
        let frame = frame?;
        if let Some((sent, _)) = read_stamp(&frame) {
            if sent >= measure_from_ns {
                let _ = h.record(now_ns().saturating_sub(sent).max(1));
            }
        }
    }
    Ok(h)
}

/// Sends `rate` stamped frames of `len` bytes a second to `to` until `stop`.
pub async fn paced_source(
    to: SocketAddr,
    rate: u32,
    len: usize,
    stop: CancellationToken,
) -> anyhow::Result<u64> {
    let conn = TcpStream::connect(to).await?;
    conn.set_nodelay(true)?;
    let mut wr = FramedWrite::new(conn, LengthDelimitedCodec::new());
    let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = pace.tick() => {
                seq += 1;
                wr.send(stamped(len, seq)).await?;
            }
        }
    }
    Ok(seq)
}

/// The latency of `rate` frames a second of `len` bytes through a chain starting at `head` and
/// ending at `sink_listener`, measured for `measure` after `warm_up`.
pub async fn measure_chain(
    head: SocketAddr,
    sink_listener: TcpListener,
    rate: u32,
    len: usize,
    warm_up: Duration,
    measure: Duration,
) -> anyhow::Result<Histogram<u64>> {
    let stop = CancellationToken::new();
    let from = now_ns() + warm_up.as_nanos() as u64;
    let sink = tokio::spawn(sink(sink_listener, from, stop.clone()));
    let source = tokio::spawn(paced_source(head, rate, len, stop.clone()));
    tokio::time::sleep(warm_up + measure).await;
    stop.cancel();
    source.await.context("the source task")??;
    sink.await.context("the sink task")?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_cross_a_chain_of_forwarders_and_are_measured() {
        let sink_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (head, _tasks) = chain_in_process(3, sink_l.local_addr().unwrap())
            .await
            .unwrap();
        let h = measure_chain(
            head,
            sink_l,
            500,
            64,
            Duration::from_millis(100),
            Duration::from_millis(400),
        )
        .await
        .unwrap();
        // 500/s for 0.4 s: about 200 frames, every one through three forwarders.
        assert!((100..=260).contains(&h.len()), "{} frames", h.len());
        assert!(h.min() > 0);
    }
}
