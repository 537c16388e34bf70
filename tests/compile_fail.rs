//! Borrow and ownership rules that rdmakit's soundness relies on, pinned as programs that must
//! not compile (trybuild; the expected errors are next to each file in `tests/compile-fail/`),
//! and the API promise that option structs are `#[non_exhaustive]` (built with `Default` and
//! `with_*` setters, never a struct literal, so fields can be added without breaking users).

#[test]
fn soundness_rules_are_enforced_by_the_compiler() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile-fail/*.rs");
}
