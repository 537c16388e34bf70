//! Helpers shared by this crate's integration tests.
#![allow(dead_code)] // each test crate uses some of these

/// `len` bytes of fresh anonymous memory of our own (for `register_raw`), unmapped by the
/// caller.
pub fn anonymous(len: usize) -> *mut libc::c_void {
    // SAFETY: a plain anonymous mapping, no address asked for.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
    mem
}

/// A TCP connection from loopback address `127.0.0.<host>` to `port`.
pub fn tcp_from(host: u8, port: u16) -> std::net::TcpStream {
    // SAFETY: plain socket calls on a descriptor this function owns until it hands it to
    // `TcpStream` (which then owns and closes it); the sockaddr structs live on the stack.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let sa = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let me = sa(std::net::Ipv4Addr::new(127, 0, 0, host), 0);
        assert_eq!(
            libc::bind(fd, (&raw const me).cast(), len),
            0,
            "bind: {}",
            std::io::Error::last_os_error()
        );
        let to = sa(std::net::Ipv4Addr::LOCALHOST, port);
        assert_eq!(
            libc::connect(fd, (&raw const to).cast(), len),
            0,
            "connect: {}",
            std::io::Error::last_os_error()
        );
        std::os::fd::FromRawFd::from_raw_fd(fd)
    }
}
