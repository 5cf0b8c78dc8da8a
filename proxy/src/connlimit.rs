//! Connection limits: how many client connections the proxy holds at once, in total and per
//! address. A connection over either limit is told `Kick{OVERLOADED}` and closed before any task
//! or buffer is spent on it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// The address a limit counts by: an IPv4 address as it is (an IPv4-mapped IPv6 one too), an
/// IPv6 address by its /64, the block one host or one subscriber line is given whole.
pub(crate) fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let net = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(Ipv6Addr::from(net))
            }
        },
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The proxy holds `max_connections` already.
    Total(usize),
    /// The address holds `max_connections_per_address` already.
    Address(usize),
}

impl Refusal {
    pub(crate) fn detail(&self) -> String {
        match self {
            Refusal::Total(max) => {
                format!("the proxy holds its maximum of {max} connections; retry in a moment")
            }
            Refusal::Address(max) => format!(
                "your address holds the maximum of {max} connections per address; close one first"
            ),
        }
    }

    pub(crate) fn label(&self) -> &'static str {
        match self {
            Refusal::Total(_) => "total",
            Refusal::Address(_) => "address",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// The connections open now, by address.
#[derive(Debug)]
pub(crate) struct ConnectionLimits {
    max_total: usize,
    max_per_address: usize,
    counts: Arc<Mutex<Counts>>,
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub(crate) struct ConnectionPermit {
    key: IpAddr,
    counts: Arc<Mutex<Counts>>,
}

impl ConnectionLimits {
    pub(crate) fn new(max_total: usize, max_per_address: usize) -> Self {
        Self {
            max_total,
            max_per_address,
            counts: Arc::default(),
        }
    }

    /// Admits a connection from `ip`, or says which limit it hit.
    pub(crate) fn admit(&self, ip: IpAddr) -> Result<ConnectionPermit, Refusal> {
        let key = address_key(ip);
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if c.total >= self.max_total {
            return Err(Refusal::Total(self.max_total));
        }
        let here = c.by_address.entry(key).or_default();
        if *here >= self.max_per_address {
            return Err(Refusal::Address(self.max_per_address));
        }
        *here += 1;
        c.total += 1;
        Ok(ConnectionPermit {
            key,
            counts: self.counts.clone(),
        })
    }

    /// Connections open now, and addresses they come from.
    pub(crate) fn open(&self) -> (usize, usize) {
        let c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        (c.total, c.by_address.len())
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total -= 1;
        if let Some(n) = c.by_address.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                c.by_address.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, last])
    }

    #[test]
    fn ipv6_counts_by_its_slash_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:ffff:ffff:ffff".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(c));
        assert_eq!(address_key(a), "2001:db8:1:2::".parse::<IpAddr>().unwrap());
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(address_key(mapped), v4(7));
        assert_eq!(address_key(v4(7)), v4(7));
    }

    #[test]
    fn per_address_then_total_and_permits_give_their_place_back() {
        let limits = ConnectionLimits::new(4, 2);
        let a1 = limits.admit(v4(1)).unwrap();
        let _a2 = limits.admit(v4(1)).unwrap();
        assert_eq!(limits.admit(v4(1)).unwrap_err(), Refusal::Address(2));
        let _b1 = limits.admit(v4(2)).unwrap();
        let _c1 = limits.admit(v4(3)).unwrap();
        assert_eq!(limits.admit(v4(4)).unwrap_err(), Refusal::Total(4));
        assert_eq!(limits.open(), (4, 3));
        drop(a1);
        assert_eq!(limits.open(), (3, 3));
        let _a3 = limits.admit(v4(1)).unwrap();
        let v6_host = |i: u16| IpAddr::from([0x2001, 0xdb8, 0, 9, 0, 0, 0, i]);
        let limits = ConnectionLimits::new(100, 2);
        let _x = limits.admit(v6_host(1)).unwrap();
        let _y = limits.admit(v6_host(2)).unwrap();
        assert_eq!(
            limits.admit(v6_host(3)).unwrap_err(),
            Refusal::Address(2),
            "another address of the same /64"
        );
        drop((_x, _y));
        assert_eq!(limits.open(), (0, 0), "nothing kept for departed addresses");
    }
}
