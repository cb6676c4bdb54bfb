//! Continuous-batching scheduler: decides what each engine step contains. Running decodes go
//! first (one token each, so a long prompt never stalls streams that are already generating);
//! the rest of the token budget goes to prompt chunks in arrival order (chunked prefill).
//! A plain struct with no I/O, unit-tested on its own.

use std::collections::{HashMap, VecDeque};

/// What a sequence does in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Prompt tokens `offset..offset + len`; `last` when this chunk ends the prompt.
    Prefill { offset: usize, len: usize, last: bool },
    /// One generated token.
    Decode,
}

impl Work {
    pub fn tokens(&self) -> usize {
        match *self {
            Work::Prefill { len, .. } => len,
            Work::Decode => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: u64,
    pub work: Work,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    prompt_len: usize,
    prefilled: usize,
}

/// Why a sequence cannot be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("sequence {0} is already scheduled")]
    Duplicate(u64),
    #[error("sequence {0} has an empty prompt")]
    EmptyPrompt(u64),
}

/// Plans steps under a token budget and a limit on sequences in flight.
#[derive(Debug, Clone)]
pub struct Scheduler {
    budget: usize,
    max_running: usize,
    /// Admitted sequences in arrival order.
    running: Vec<u64>,
    waiting: VecDeque<u64>,
    entries: HashMap<u64, Entry>,
}

impl Scheduler {
    /// `budget` tokens per step (≥ 1), at most `max_running` sequences admitted at once (≥ 1).
    pub fn new(budget: usize, max_running: usize) -> Self {
        Self {
            budget: budget.max(1),
            max_running: max_running.max(1),
            running: Vec::new(),
            waiting: VecDeque::new(),
            entries: HashMap::new(),
        }
    }

    pub fn add(&mut self, id: u64, prompt_len: usize) -> Result<(), ScheduleError> {
        if self.entries.contains_key(&id) {
            return Err(ScheduleError::Duplicate(id));
        }
        if prompt_len == 0 {
            return Err(ScheduleError::EmptyPrompt(id));
        }
        self.entries.insert(id, Entry { prompt_len, prefilled: 0 });
        self.waiting.push_back(id);
        Ok(())
    }

    /// Adds a sequence whose prompt KV is already in place (computed elsewhere): it only decodes.
    pub fn add_prefilled(&mut self, id: u64, prompt_len: usize) -> Result<(), ScheduleError> {
        self.add_from(id, prompt_len, prompt_len)
    }

    /// Adds a sequence whose first `done` prompt tokens have their KV in place (a cached
    /// prefix): only the rest is prefilled.
    pub fn add_from(
        &mut self,
        id: u64,
        prompt_len: usize,
        done: usize,
    ) -> Result<(), ScheduleError> {
        self.add(id, prompt_len)?;
        self.entries.get_mut(&id).expect("just added").prefilled = done.min(prompt_len);
        Ok(())
    }

    /// Forgets a sequence (finished, cancelled or failed).
    pub fn remove(&mut self, id: u64) -> bool {
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        self.entries.remove(&id).is_some()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The next step's contents. Progress is recorded as planned: the caller runs the step and
    /// removes sequences that finish or fail.
    pub fn plan(&mut self) -> Vec<Scheduled> {
        let budget = self.budget;
        self.plan_with(&|_| budget)
    }

    /// `plan` with the step's token budget chosen by `budget` from the number of sequences
    /// decoding in it (a pacer keeping steps with streams in them short), capped at this
    /// scheduler's own.
    pub fn plan_with(&mut self, budget: &dyn Fn(usize) -> usize) -> Vec<Scheduled> {
        while self.running.len() < self.max_running {
            match self.waiting.pop_front() {
                Some(id) => self.running.push(id),
                None => break,
            }
        }
        let decoding = self
            .running
            .iter()
            .filter(|id| self.entries[id].prefilled == self.entries[id].prompt_len)
            .count();
        let mut left = budget(decoding).clamp(1, self.budget);
        let mut out = Vec::new();
        for &id in &self.running {
            if left == 0 {
                break;
            }
            let e = &self.entries[&id];
            if e.prefilled == e.prompt_len {
                out.push(Scheduled { id, work: Work::Decode });
                left -= 1;
            }
        }
        for &id in &self.running {
            if left == 0 {
                break;
            }
            let e = self.entries.get_mut(&id).expect("running ids have entries");
            if e.prefilled < e.prompt_len {
                let len = (e.prompt_len - e.prefilled).min(left);
                out.push(Scheduled {
                    id,
                    work: Work::Prefill {
                        offset: e.prefilled,
                        len,
                        last: e.prefilled + len == e.prompt_len,
                    },
                });
                e.prefilled += len;
                left -= len;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_first_then_prefill_chunks_within_budget() {
        let mut s = Scheduler::new(8, 4);
        s.add(1, 3).unwrap();
        s.add(2, 20).unwrap();
        let p = s.plan();
        assert_eq!(
            p,
            vec![
                Scheduled { id: 1, work: Work::Prefill { offset: 0, len: 3, last: true } },
                Scheduled { id: 2, work: Work::Prefill { offset: 0, len: 5, last: false } },
            ]
        );
        let p = s.plan();
        assert_eq!(p[0], Scheduled { id: 1, work: Work::Decode });
        assert_eq!(
            p[1],
            Scheduled { id: 2, work: Work::Prefill { offset: 5, len: 7, last: false } }
        );
        let p = s.plan();
        assert_eq!(
            p[1],
            Scheduled { id: 2, work: Work::Prefill { offset: 12, len: 7, last: false } }
        );
        let p = s.plan();
        assert_eq!(
            p[1],
            Scheduled { id: 2, work: Work::Prefill { offset: 19, len: 1, last: true } }
        );
        assert_eq!(s.plan().len(), 2);
    }

    /// A paced step: the budget follows the number decoding (here: room for 3 prompt tokens
    /// beside them), and the prompt advances in smaller chunks while streams run.
    #[test]
    fn a_paced_budget_shrinks_prompt_chunks_while_streams_decode() {
        let mut s = Scheduler::new(8, 4);
        s.add_prefilled(1, 5).unwrap();
        s.add_prefilled(2, 5).unwrap();
        s.add(3, 20).unwrap();
        let paced = |decoding: usize| decoding + 3;
        let p = s.plan_with(&paced);
        assert_eq!(p.len(), 3);
        assert_eq!(
            p[2],
            Scheduled { id: 3, work: Work::Prefill { offset: 0, len: 3, last: false } }
        );
        s.remove(1);
        s.remove(2);
        // Nobody decoding: the pacer gives what it likes, never more than the scheduler's own.
        let p = s.plan_with(&|_| 100);
        assert_eq!(
            p,
            [Scheduled { id: 3, work: Work::Prefill { offset: 3, len: 8, last: false } }]
        );
    }

    #[test]
    fn a_cached_prefix_is_not_prefilled_again() {
        let mut s = Scheduler::new(8, 4);
        s.add_from(1, 20, 16).unwrap();
        assert_eq!(
            s.plan(),
            vec![Scheduled { id: 1, work: Work::Prefill { offset: 16, len: 4, last: true } }]
        );
        assert_eq!(s.plan(), vec![Scheduled { id: 1, work: Work::Decode }]);
        // `done` past the prompt means all of it.
        s.add_from(2, 5, 9).unwrap();
        assert_eq!(s.plan()[1], Scheduled { id: 2, work: Work::Decode });
    }

    #[test]
    fn prefilled_sequences_only_decode() {
        let mut s = Scheduler::new(8, 4);
        s.add_prefilled(1, 30).unwrap();
        s.add(2, 20).unwrap();
        let p = s.plan();
        assert_eq!(p[0], Scheduled { id: 1, work: Work::Decode });
        assert_eq!(
            p[1],
            Scheduled { id: 2, work: Work::Prefill { offset: 0, len: 7, last: false } }
        );
        assert_eq!(s.add_prefilled(1, 3), Err(ScheduleError::Duplicate(1)));
    }

    #[test]
    fn never_exceeds_budget_and_never_starves() {
        let mut s = Scheduler::new(5, 3);
        for id in 0..10 {
            s.add(id, 1 + (id as usize * 7) % 13).unwrap();
        }
        let mut decoded = HashMap::new();
        for _ in 0..200 {
            let p = s.plan();
            assert!(p.iter().map(|x| x.work.tokens()).sum::<usize>() <= 5);
            let mut ids: Vec<u64> = p.iter().map(|x| x.id).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), p.len(), "a sequence scheduled twice in one step");
            for x in p {
                if x.work == Work::Decode {
                    let n = decoded.entry(x.id).or_insert(0);
                    *n += 1;
                    if *n == 4 {
                        s.remove(x.id);
                    }
                }
            }
        }
        assert!(s.is_empty(), "some sequences never finished: {}", s.len());
        assert_eq!(decoded.len(), 10);
    }

    #[test]
    fn admission_limit_holds_sequences_back() {
        let mut s = Scheduler::new(100, 2);
        for id in 0..3 {
            s.add(id, 4).unwrap();
        }
        let p = s.plan();
        assert_eq!(p.iter().map(|x| x.id).collect::<Vec<_>>(), vec![0, 1]);
        s.remove(0);
        let p = s.plan();
        assert_eq!(p.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn rejects_duplicates_and_empty_prompts() {
        let mut s = Scheduler::new(4, 4);
        s.add(1, 2).unwrap();
        assert_eq!(s.add(1, 2), Err(ScheduleError::Duplicate(1)));
        assert_eq!(s.add(2, 0), Err(ScheduleError::EmptyPrompt(2)));
    }
}
