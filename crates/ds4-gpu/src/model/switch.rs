//! The `DS4_GPU_*` environment switches. Each is a process-wide code in an `AtomicU8` cell: read
//! from its variable on first use and kept, unless a setter (tests, A/B benchmarks) stored a code
//! first, which then wins. Each variable's names, default and codes are documented beside its
//! cell. Two cell conventions, as the files had them (their codes and setters are unchanged):
//! - codes from 1, 0 = not read yet: [`env_code`], [`env_pick`], [`env_form`], [`set_code`]
//!   (attn.rs, mix.rs, blas.rs `DS4_GPU_BLAS_ACC`, matvec.rs `DS4_GPU_MVRN`, moe.rs
//!   `DS4_GPU_MOE_TOKENS`);
//! - codes from 0, [`UNSET`] = not read yet: [`code`], [`switch_on`] (gemm*.rs, blas.rs).

use std::sync::atomic::{AtomicU8, Ordering};

/// "Not read yet" of the cells whose codes start at 0.
pub(super) const UNSET: u8 = 255;

/// The code in `cell`; while it holds `unread`, `parse` maps the variable's value (None: unset,
/// or not Unicode) to a code, stored unless a setter stored one first (a racing setter wins).
fn read(cell: &AtomicU8, unread: u8, var: &str, parse: impl FnOnce(Option<&str>) -> u8) -> u8 {
    let m = cell.load(Ordering::Relaxed);
    if m != unread {
        return m;
    }
    let env = parse(std::env::var(var).ok().as_deref());
    match cell.compare_exchange(unread, env, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => env,
        Err(cur) => cur,
    }
}

/// A cell of codes from 1 (0: not read yet): `parse` maps the value of `var` to a nonzero code.
pub(super) fn env_code(cell: &AtomicU8, var: &str, parse: impl FnOnce(Option<&str>) -> u8) -> u8 {
    read(cell, 0, var, parse)
}

/// A cell of codes from 1: the code of the first `names` entry equal to the value of `var`,
/// else `dflt`.
pub(super) fn env_pick(cell: &AtomicU8, var: &str, names: &[(&str, u8)], dflt: u8) -> u8 {
    env_code(cell, var, |v| {
        names
            .iter()
            .find(|(n, _)| v == Some(*n))
            .map_or(dflt, |&(_, c)| c)
    })
}

/// A two-way cell of codes from 1: 1 when `var` equals `alt`, else 2; true for 1.
pub(super) fn env_form(cell: &AtomicU8, var: &str, alt: &str) -> bool {
    env_pick(cell, var, &[(alt, 1)], 2) == 1
}

/// `off` or `0`: 2, anything else (or unset): 1 (on).
pub(super) fn on_unless_off(v: Option<&str>) -> u8 {
    if matches!(v, Some("off") | Some("0")) {
        2
    } else {
        1
    }
}

/// A form setter's store into a cell of codes from 1: `names[i]` is code `i + 1` (overrides the
/// variable); an unknown name panics, naming the setter `what` and the known names.
pub(super) fn set_code(cell: &AtomicU8, what: &str, form: &str, names: &[&str]) {
    let Some(i) = names.iter().position(|n| *n == form) else {
        panic!("{what}: unknown form {form:?} ({})", names.join(", "));
    };
    cell.store(i as u8 + 1, Ordering::Relaxed);
}

/// A cell of codes from 0 ([`UNSET`]: not read yet): `parse` maps the value of `var` to a code.
pub(super) fn code(cell: &AtomicU8, var: &str, parse: impl FnOnce(Option<&str>) -> u8) -> u8 {
    read(cell, UNSET, var, parse)
}

/// A switch that is on unless `var` is `0` (cell: 0 off, 1 on, [`UNSET`] not read yet).
pub(super) fn switch_on(cell: &AtomicU8, var: &str) -> bool {
    code(cell, var, |v| (v != Some("0")) as u8) == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_code_stores_the_names_position_plus_one() {
        let cell = AtomicU8::new(0);
        set_code(&cell, "t", "simple", &["glue", "simple", "fast"]);
        assert_eq!(cell.load(Ordering::Relaxed), 2);
        set_code(&cell, "t", "glue", &["glue", "simple", "fast"]);
        assert_eq!(cell.load(Ordering::Relaxed), 1);
        let e = std::panic::catch_unwind(|| set_code(&AtomicU8::new(0), "t", "x", &["on", "off"]));
        let msg = e.unwrap_err().downcast::<String>().unwrap();
        assert!(msg.contains("unknown form \"x\" (on, off)"), "{msg}");
    }

    #[test]
    fn a_stored_code_wins_over_the_variable() {
        // No test sets these names: the parser sees them unset.
        let var = "DS4_GPU_SWITCH_TEST_UNSET";
        let c = AtomicU8::new(0);
        assert_eq!(env_pick(&c, var, &[("x", 1)], 3), 3);
        c.store(1, Ordering::Relaxed);
        assert_eq!(env_pick(&c, var, &[("x", 1)], 3), 1);
        let u = AtomicU8::new(UNSET);
        assert!(switch_on(&u, var));
        u.store(0, Ordering::Relaxed);
        assert!(!switch_on(&u, var));
        assert_eq!(code(&AtomicU8::new(UNSET), var, |v| v.is_none() as u8), 1);
        assert_eq!(env_code(&AtomicU8::new(0), var, on_unless_off), 1);
    }
}
