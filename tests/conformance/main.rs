//! The conformance suite: every case runs against the soft NIC, and against rdma-core
//! (`verbs`) when a verbs device exists. Where one does not, the verbs cases are reported as
//! *ignored*, with the reason printed, never as passed.
//!
//! The same case passing on both providers is how rdmakit knows the soft NIC is honest.
//! Run only one provider with a name filter: `cargo test --test conformance -- soft::`.
//!
//! Environment: `RDMAKIT_DEVICE` picks the verbs device; `RDMAKIT_GID_INDEX` its GID
//! index (the rxe VM sets 1).

mod channel;
mod fixture;
mod heap;
mod memory;
mod model;
mod verbs_api;

use libtest_mimic::{Arguments, Trial};
use rdmakit::ProviderKind;

fn main() {
    let args = Arguments::from_args();
    let verbs_skip = fixture::verbs_skip_reason();
    if let Some(reason) = &verbs_skip {
        eprintln!("conformance: verbs cases ignored: {reason}");
    }
    let mut trials = Vec::new();
    for case in verbs_api::CASES.iter().chain(heap::CASES).chain(memory::CASES).chain(channel::CASES) {
        for provider in [ProviderKind::Soft, ProviderKind::Verbs] {
            let name = format!("{provider}::{}", case.name);
            let skip = match provider {
                ProviderKind::Verbs => verbs_skip.clone(),
                ProviderKind::Soft => None,
            }
            .or_else(|| fixture::requirement_unmet(provider, case.needs));
            if let Some(reason) = &skip
                && (provider == ProviderKind::Soft || verbs_skip.is_none())
            {
                eprintln!("conformance: {name} ignored: {reason}");
            }
            let run = case.run;
            let trial = Trial::test(name, move || {
                let env = fixture::Env::new(provider)?;
                run(&env)
            });
            trials.push(trial.with_ignored_flag(skip.is_some()));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
