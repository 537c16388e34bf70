//! Borrow and ownership rules that rdmakit's soundness relies on, pinned as programs that must
//! not compile (trybuild; the expected errors are next to each file in `tests/compile-fail/`).

#[test]
fn soundness_rules_are_enforced_by_the_compiler() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile-fail/*.rs");
}
