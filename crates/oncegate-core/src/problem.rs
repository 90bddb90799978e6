//! One problem type and one range check for every configuration layer (limits, engine,
//! server), and the unit every quantity is printed with.

use std::fmt;

/// The unit of a quantity, printed after every number of a message so that an operator
/// reads "shard is 5; it must be between 0 and 1", not "5 ms".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Milliseconds.
    Ms,
    /// Bytes.
    Bytes,
    /// A plain count or number.
    Count,
}

impl Unit {
    /// The suffix printed after a number: " ms", " bytes" or nothing.
    pub const fn suffix(self) -> &'static str {
        match self {
            Unit::Ms => " ms",
            Unit::Bytes => " bytes",
            Unit::Count => "",
        }
    }
}

/// A value with its unit, as messages print it.
pub(crate) struct Quantity(pub u64, pub Unit);

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.0, self.1.suffix())
    }
}

/// One problem in a configuration: the setting's dotted path and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {detail}")]
pub struct Problem {
    /// The setting, as a dotted path (`engine.shards`, `tenants[1].name`).
    pub field: String,
    /// What is wrong, with the value and the bound it breaks.
    pub detail: String,
}

impl Problem {
    /// A problem with a setting.
    pub fn new(field: impl Into<String>, detail: impl Into<String>) -> Problem {
        Problem { field: field.into(), detail: detail.into() }
    }

    /// The same problem seen from the enclosing section (`shards` becomes `engine.shards`).
    pub fn under(self, section: &str) -> Problem {
        Problem { field: format!("{section}.{}", self.field), detail: self.detail }
    }
}

/// Collects every problem of a configuration, so an operator sees all of them at once.
#[derive(Debug, Default)]
pub struct Problems(Vec<Problem>);

impl Problems {
    /// Checks that `value` lies in `min..=max`.
    pub fn within(&mut self, field: &str, value: u64, min: u64, max: u64, unit: Unit) {
        self.within_because(field, value, min, max, unit, "");
    }

    /// [`Problems::within`], with why the lower bound is what it is (`why` follows it).
    pub fn within_because(&mut self, field: &str, value: u64, min: u64, max: u64, unit: Unit, why: &str) {
        if value < min || value > max {
            let (value, min, max) = (Quantity(value, unit), Quantity(min, unit), Quantity(max, unit));
            self.push(Problem::new(field, format!("is {value}; it must be between {min}{why} and {max}")));
        }
    }

    /// Adds a problem.
    pub fn push(&mut self, problem: Problem) {
        self.0.push(problem);
    }

    /// Adds problems found elsewhere, as they are.
    pub fn extend(&mut self, problems: Vec<Problem>) {
        self.0.extend(problems);
    }

    /// Adds the problems of a section, each under the section's name.
    pub fn extend_under(&mut self, section: &str, problems: Vec<Problem>) {
        self.0.extend(problems.into_iter().map(|p| p.under(section)));
    }

    /// `Ok` when nothing was found, otherwise every problem.
    pub fn into_result(self) -> Result<(), Vec<Problem>> {
        if self.0.is_empty() { Ok(()) } else { Err(self.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_print_their_unit_and_sections_nest() {
        let mut problems = Problems::default();
        problems.within("shards", 0, 1, 1024, Unit::Count);
        problems.within("lease_ms", 5, 100, 200, Unit::Ms);
        problems.within("ok", 5, 1, 10, Unit::Bytes);
        let problems = problems.into_result().unwrap_err();
        assert_eq!(
            problems[0].clone().under("engine").to_string(),
            "engine.shards is 0; it must be between 1 and 1024"
        );
        assert_eq!(problems[1].to_string(), "lease_ms is 5 ms; it must be between 100 ms and 200 ms");
        assert_eq!(problems.len(), 2);
    }
}
