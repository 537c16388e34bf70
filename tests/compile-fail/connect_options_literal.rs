//! `ConnectOptions` is `#[non_exhaustive]`: outside rdmakit it is built from `Default` and its
//! `with_*` setters, never as a struct literal, so adding a field breaks nobody.

use rdmakit::ConnectOptions;

fn main() {
    let _opts = ConnectOptions { timeout: 12, ..ConnectOptions::default() };
}
