//! When to write checkpoints and how long they are (interfaces.md §5.3): pure functions the
//! server calls; nothing here touches the disk.

/// The `--kv-cache-*` knobs, with the documented defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// `--kv-cache-min-tokens`: never store or load shorter checkpoints.
    pub min_tokens: usize,
    /// `--kv-cache-cold-max-tokens`: cold stores only for prompts of at most this many
    /// tokens; 0 disables cold stores.
    pub cold_max_tokens: usize,
    /// `--kv-cache-continued-interval-tokens`: 0 disables continued stores.
    pub continued_interval_tokens: usize,
    /// `--kv-cache-boundary-trim-tokens`: tail dropped from non-anchor cold stores.
    pub boundary_trim_tokens: usize,
    /// `--kv-cache-boundary-align-tokens`: 0 disables alignment.
    pub boundary_align_tokens: usize,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            min_tokens: 512,
            cold_max_tokens: 30000,
            continued_interval_tokens: 10000,
            boundary_trim_tokens: 32,
            boundary_align_tokens: 2048,
        }
    }
}

/// `--kv-disk-space-mb` default when the disk cache is enabled.
pub const DEFAULT_DISK_SPACE_MB: u64 = 4096;

impl Policy {
    /// Checks the knobs' relations; the message names the flag at fault.
    pub fn validate(&self) -> Result<(), String> {
        if self.cold_max_tokens != 0 && self.cold_max_tokens < self.min_tokens {
            return Err(format!(
                "--kv-cache-cold-max-tokens {} must be 0 or at least --kv-cache-min-tokens {}",
                self.cold_max_tokens, self.min_tokens
            ));
        }
        Ok(())
    }

    /// Length of the cold checkpoint for a request that reused no cached tokens, or `None`
    /// when no cold store applies. `user`/`assistant` are the `<｜User｜>` and
    /// `<｜Assistant｜>` token ids: the preferred length is the "chat anchor", the index of
    /// the last user token before the first assistant token (the system + tools prefix).
    /// Otherwise `len - trim` rounded down to the alignment, otherwise the whole prompt.
    pub fn cold_store_len(&self, prompt: &[u32], user: u32, assistant: u32) -> Option<usize> {
        let n = prompt.len();
        if self.cold_max_tokens == 0 || n < self.min_tokens.max(1) || n > self.cold_max_tokens {
            return None;
        }
        let first_asst = prompt.iter().position(|&t| t == assistant).unwrap_or(n);
        let anchor = prompt[..first_asst].iter().rposition(|&t| t == user);
        if let Some(a) = anchor {
            if a >= self.min_tokens && a > 0 {
                return Some(a);
            }
        }
        let mut t = n.saturating_sub(self.boundary_trim_tokens);
        if self.boundary_align_tokens > 0 {
            t -= t % self.boundary_align_tokens;
        }
        if t >= self.min_tokens && t > 0 {
            Some(t)
        } else {
            Some(n)
        }
    }

    /// Distance between continued checkpoints: the interval rounded up to the alignment
    /// (10000 → 10240 with the defaults); `None` when continued stores are disabled.
    pub fn continued_step(&self) -> Option<usize> {
        if self.continued_interval_tokens == 0 {
            return None;
        }
        let a = self.boundary_align_tokens.max(1);
        Some(self.continued_interval_tokens.div_ceil(a) * a)
    }

    /// Whether a session now holding `n` tokens should write a continued checkpoint, given
    /// the length of the last one it stored (0 if none). The caller skips this while inside a
    /// DSML tool block.
    pub fn continued_due(&self, n: usize, last_stored: usize) -> bool {
        match self.continued_step() {
            Some(step) => n > last_stored && n >= self.min_tokens && n.is_multiple_of(step),
            None => false,
        }
    }

    /// Prefill chunk boundaries that hit continued frontiers: the lengths in
    /// `(from, to]` at which a continued checkpoint is due, so a prefill can stop there.
    pub fn continued_frontiers(&self, from: usize, to: usize) -> Vec<usize> {
        let Some(step) = self.continued_step() else {
            return Vec::new();
        };
        let first = (from / step + 1) * step;
        (first..=to)
            .step_by(step)
            .filter(|&n| n >= self.min_tokens)
            .collect()
    }

    /// Whether a whole live session (reasons `evict` and `shutdown`) is worth storing.
    pub fn store_whole(&self, n: usize) -> bool {
        n > 0 && n >= self.min_tokens
    }

    /// Whether a checkpoint of `n` tokens may be loaded (the lookup's lower bound).
    pub fn loadable(&self, n: usize) -> bool {
        n >= self.min_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u32 = 1;
    const A: u32 = 2;

    #[test]
    fn defaults_match_the_documented_flags() {
        let p = Policy::default();
        assert_eq!(
            (p.min_tokens, p.cold_max_tokens, p.continued_interval_tokens),
            (512, 30000, 10000)
        );
        assert_eq!(
            (p.boundary_trim_tokens, p.boundary_align_tokens),
            (32, 2048)
        );
        assert_eq!(p.continued_step(), Some(10240));
        assert!(p.validate().is_ok());
        let bad = Policy {
            cold_max_tokens: 100,
            ..p
        };
        assert!(bad.validate().unwrap_err().contains("cold-max"));
    }

    #[test]
    fn cold_length_prefers_the_chat_anchor_then_aligned_trim_then_whole() {
        let p = Policy::default();
        // system prefix of 700 tokens, then <User> ... <Assistant>
        let mut prompt = vec![7u32; 700];
        prompt.push(U);
        prompt.extend(vec![8u32; 50]);
        prompt.push(A);
        assert_eq!(p.cold_store_len(&prompt, U, A), Some(700));
        // A user token after the first assistant token is not the anchor.
        let mut p2 = vec![7u32; 600];
        p2.push(A);
        p2.extend(vec![8u32; 3000]);
        p2.push(U);
        // no anchor: 3602 - 32 = 3570 → 2048
        assert_eq!(p.cold_store_len(&p2, U, A), Some(2048));
        // anchor too short, aligned length too short: whole prompt
        let mut p3 = vec![U; 1];
        p3.extend(vec![7u32; 1000]);
        assert_eq!(p.cold_store_len(&p3, U, A), Some(1001));
        // outside [min, cold_max]
        assert_eq!(p.cold_store_len(&[7; 100], U, A), None);
        assert_eq!(p.cold_store_len(&vec![7; 30001], U, A), None);
        let off = Policy {
            cold_max_tokens: 0,
            ..Policy::default()
        };
        assert_eq!(off.cold_store_len(&prompt, U, A), None);
        // alignment disabled: just the trim
        let na = Policy {
            boundary_align_tokens: 0,
            ..Policy::default()
        };
        assert_eq!(na.cold_store_len(&p2, U, A), Some(3570));
    }

    #[test]
    fn continued_frontiers() {
        let p = Policy::default();
        assert!(p.continued_due(10240, 0));
        assert!(!p.continued_due(10240, 10240));
        assert!(!p.continued_due(10000, 0));
        assert_eq!(p.continued_frontiers(0, 30000), vec![10240, 20480]);
        assert_eq!(p.continued_frontiers(10240, 20480), vec![20480]);
        let off = Policy {
            continued_interval_tokens: 0,
            ..Policy::default()
        };
        assert_eq!(off.continued_step(), None);
        assert!(!off.continued_due(10240, 0));
        let unaligned = Policy {
            boundary_align_tokens: 0,
            ..Policy::default()
        };
        assert_eq!(unaligned.continued_step(), Some(10000));
        assert!(p.store_whole(512) && !p.store_whole(511));
    }
}
