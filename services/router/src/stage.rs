//! A request's life between attempts, as a typed stage machine: where it stands (`Stage`),
//! what went wrong with its last attempt (`Fault`), and the pure `decide` that gives the next
//! stage and what the relay does (`Action`). No I/O and no clocks: every path through it is a
//! unit test, as placement's are, and `relay` only carries the actions out.

use crate::attempt::Failure;

/// Retries a request gets before its first token reaches the client, at least (more with a
/// larger `max_migrations`: a node lost before the first token is as recoverable as one lost
/// after it).
const RETRIES: u32 = 1;

/// Times a moving stream's re-prefill may fail (each failed prefill node is avoided after;
/// with none left its decode node computes the prompt).
const MAX_RECOMPUTES: u32 = 4;

/// Times a request may be preempted. The youngest growing stream is the one preempted, so a
/// request waits its turn rather than being preempted again and again; past this bound
/// something is wrong, and the client gets the node's ABORTED.
const MAX_PREEMPTIONS: u32 = 32;

/// How many of each kind of failure a request survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Failed attempts retried before the first token reaches the client.
    pub retries: u32,
    /// Losses of a streaming request's decode node (the stream moves).
    pub migrations: u32,
    /// Failed re-prefills of a moving stream.
    pub recomputes: u32,
    pub preemptions: u32,
}

impl Limits {
    /// The limits for a router allowing `max_migrations` moves.
    pub fn new(max_migrations: u32) -> Self {
        Self {
            retries: RETRIES.max(max_migrations),
            migrations: max_migrations,
            recomputes: MAX_RECOMPUTES,
            preemptions: MAX_PREEMPTIONS,
        }
    }
}

/// How a request's course has gone so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Course {
    /// No attempt has failed in a way that counted.
    #[default]
    Fresh,
    /// An attempt failed before the client saw a token; others are tried.
    Retrying,
    /// The stream's node was lost, or its re-prefill failed, after the client saw tokens: the
    /// stream continues elsewhere from where it stands.
    Moving,
}

/// Why the next attempt waits for room first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The decode node chosen had no room after all (the router's view is a heartbeat old).
    Full,
    /// Its decode node preempted it; it continues, from where its stream stands, once there is
    /// room (there or anywhere).
    Preempted,
}

/// What was spent of each budget in `Limits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Spent {
    pub retries: u32,
    pub migrations: u32,
    pub recomputes: u32,
    pub preemptions: u32,
}

/// Where a request stands between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Stage {
    pub course: Course,
    /// Set when the next attempt waits for room before it is placed.
    pub hold: Option<Hold>,
    pub spent: Spent,
}

/// How placement treats a mesh with no room for the next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Fail at once (a retry takes the room there is).
    Never,
    /// Wait for room if there is none.
    IfFull,
    /// Wait for room before trying (the node chosen turned it down as full).
    First,
}

impl Stage {
    /// How the next attempt is placed: a held request waits for room first; a fresh one waits
    /// if there is none; any other takes what there is.
    pub fn wait(&self, first_sent: bool) -> Wait {
        match (self.hold, self.course) {
            (Some(_), _) => Wait::First,
            (None, Course::Fresh) if !first_sent => Wait::IfFull,
            (None, _) => Wait::Never,
        }
    }
}

/// What went wrong with an attempt, told apart as `decide` needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The attempt's decode node turned its reservation down as full (RESOURCE_EXHAUSTED).
    Full,
    /// The attempt's decode node preempted it (ABORTED: out of blocks for its growing
    /// reservation).
    Preempted,
    /// The attempt's decode node is gone or full: worth another node.
    DecodeNode,
    /// Another of the attempt's nodes (its prefill node) is gone or full, or no node was
    /// named: worth another node.
    Elsewhere,
    /// Nothing another node would change: the failure is the answer.
    Final,
}

impl Fault {
    /// `failure` of an attempt whose decode node was `decode_node`.
    pub fn of(failure: &Failure, decode_node: &str) -> Self {
        let on_decode = failure.node() == Some(decode_node);
        match failure {
            Failure::Refused { status, .. }
                if on_decode && status.code() == tonic::Code::ResourceExhausted =>
            {
                Fault::Full
            }
            f if on_decode && f.preempted() => Fault::Preempted,
            f if !f.retryable() => Fault::Final,
            _ if on_decode => Fault::DecodeNode,
            _ => Fault::Elsewhere,
        }
    }
}

/// What the relay does after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Wait for room, then attempt again; the failure is not held against the request.
    AwaitRoom,
    /// Preempted: wait for room, then continue the stream.
    Preempted,
    /// Attempt again on other nodes, avoiding the failed one (no token reached the client).
    Retry,
    /// Move the stream to another decode node, avoiding the lost one.
    Migrate,
    /// Compute the moving stream's prompt elsewhere, avoiding the node that failed it.
    Recompute,
    /// The failure ends the request.
    Fail,
}

impl Action {
    /// Whether the failure counts: the failed node is avoided after, and the failure answers
    /// the request if no other node can take it.
    pub fn counts(self) -> bool {
        matches!(self, Action::Retry | Action::Migrate | Action::Recompute)
    }
}

/// The stage after an attempt of `stage` ended in `fault`, and what to do. `first_sent`:
/// whether the client has seen a token (a failure then moves the stream rather than retrying
/// it).
pub(crate) fn decide(
    stage: Stage,
    fault: Fault,
    first_sent: bool,
    limits: &Limits,
) -> (Stage, Action) {
    let mut next = Stage { hold: None, ..stage };
    let spent = &mut next.spent;
    // A full decode node is waited on like any full mesh while nothing else has gone wrong,
    // and always by a preempted request, which only ever waits for room.
    let waits_when_full =
        stage.hold == Some(Hold::Preempted) || (stage.course == Course::Fresh && !first_sent);
    let action = match fault {
        Fault::Full if waits_when_full => {
            // Nothing spent and the hold kept: a preempted request stays one.
            return (
                Stage { hold: Some(stage.hold.unwrap_or(Hold::Full)), ..stage },
                Action::AwaitRoom,
            );
        }
        Fault::Preempted if spent.preemptions >= limits.preemptions => Action::Fail,
        Fault::Preempted => {
            spent.preemptions += 1;
            next.hold = Some(Hold::Preempted);
            Action::Preempted
        }
        Fault::Final => Action::Fail,
        Fault::Full | Fault::DecodeNode if first_sent => {
            // The stream's decode node is lost: what the migration budget counts.
            budget(&mut spent.migrations, limits.migrations, Action::Migrate)
        }
        // A moving stream's re-prefill failed (its prefill node died with the decode node,
        // say a whole host): not a loss of the stream's node, so not the migration budget's.
        Fault::Elsewhere if first_sent => {
            budget(&mut spent.recomputes, limits.recomputes, Action::Recompute)
        }
        Fault::Full | Fault::DecodeNode | Fault::Elsewhere => {
            budget(&mut spent.retries, limits.retries, Action::Retry)
        }
    };
    next.course = match action {
        Action::Retry => Course::Retrying,
        Action::Migrate | Action::Recompute => Course::Moving,
        _ => stage.course,
    };
    (next, action)
}

/// `action`, spending one of `used` out of `limit`; `Fail` when none is left.
fn budget(used: &mut u32, limit: u32, action: Action) -> Action {
    if *used >= limit {
        return Action::Fail;
    }
    *used += 1;
    action
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { retries: 1, migrations: 2, recomputes: 1, preemptions: 2 };

    /// Runs `faults` from a fresh stage (`first_sent` for each), returning each action and the
    /// last stage.
    fn run(faults: &[(Fault, bool)]) -> (Vec<Action>, Stage) {
        let mut stage = Stage::default();
        let mut actions = Vec::new();
        for &(f, sent) in faults {
            let (s, a) = decide(stage, f, sent, &LIMITS);
            stage = s;
            actions.push(a);
        }
        (actions, stage)
    }

    #[test]
    fn a_fresh_request_waits_for_a_full_node_without_spending() {
        let (a, s) = run(&[(Fault::Full, false), (Fault::Full, false), (Fault::Full, false)]);
        assert_eq!(a, [Action::AwaitRoom; 3]);
        assert_eq!(s, Stage { hold: Some(Hold::Full), ..Stage::default() });
        assert_eq!(s.wait(false), Wait::First);
        assert_eq!(Stage::default().wait(false), Wait::IfFull);
    }

    #[test]
    fn a_retry_takes_the_room_there_is() {
        let (a, s) = run(&[(Fault::Elsewhere, false), (Fault::Full, false)]);
        // The retry found its node full: that is its one retry gone, and the answer.
        assert_eq!(a, [Action::Retry, Action::Fail]);
        assert_eq!(s.course, Course::Retrying);
        let (_, after_one) = run(&[(Fault::DecodeNode, false)]);
        assert_eq!(after_one.wait(false), Wait::Never);
    }

    #[test]
    fn retries_before_the_first_token_are_bounded() {
        let (a, _) = run(&[(Fault::DecodeNode, false), (Fault::DecodeNode, false)]);
        assert_eq!(a, [Action::Retry, Action::Fail]);
        let many = Limits::new(3);
        assert_eq!((many.retries, many.migrations), (3, 3), "retries grow with migrations");
        assert_eq!(Limits::new(0).retries, 1, "one retry whatever the migrations");
    }

    #[test]
    fn a_lost_decode_node_moves_the_stream_within_the_migration_budget() {
        let (a, s) =
            run(&[(Fault::DecodeNode, true), (Fault::Full, true), (Fault::DecodeNode, true)]);
        assert_eq!(a, [Action::Migrate, Action::Migrate, Action::Fail]);
        assert_eq!(s.course, Course::Moving);
        assert_eq!(s.spent.migrations, 2);
        assert_eq!(s.wait(true), Wait::Never);
    }

    #[test]
    fn a_failed_re_prefill_is_recomputed_not_counted_as_a_move() {
        let (a, s) =
            run(&[(Fault::DecodeNode, true), (Fault::Elsewhere, true), (Fault::Elsewhere, true)]);
        assert_eq!(a, [Action::Migrate, Action::Recompute, Action::Fail]);
        assert_eq!((s.spent.migrations, s.spent.recomputes), (1, 1));
    }

    #[test]
    fn a_preempted_request_waits_even_after_failures_and_is_bounded() {
        // Preempted after a move: the full node it meets next is waited on, not counted.
        let (a, s) = run(&[
            (Fault::DecodeNode, true),
            (Fault::Preempted, true),
            (Fault::Full, true),
            (Fault::Full, true),
        ]);
        assert_eq!(a, [Action::Migrate, Action::Preempted, Action::AwaitRoom, Action::AwaitRoom]);
        assert_eq!(s.hold, Some(Hold::Preempted), "still preempted while it waits");
        assert_eq!((s.spent.migrations, s.spent.preemptions), (1, 1));
        // Once an attempt gets further, a full node counts again.
        let (s, a) = decide(s, Fault::DecodeNode, true, &LIMITS);
        assert_eq!(a, Action::Migrate);
        let (_, a) = decide(s, Fault::Full, true, &LIMITS);
        assert_eq!(a, Action::Fail, "the migration budget is spent");
        let (a, _) =
            run(&[(Fault::Preempted, true), (Fault::Preempted, true), (Fault::Preempted, true)]);
        assert_eq!(a, [Action::Preempted, Action::Preempted, Action::Fail]);
    }

    #[test]
    fn a_final_failure_ends_the_request_at_any_stage() {
        for sent in [false, true] {
            let (a, _) = run(&[(Fault::Final, sent)]);
            assert_eq!(a, [Action::Fail]);
        }
        let (a, _) = run(&[(Fault::Preempted, true), (Fault::Final, true)]);
        assert_eq!(a, [Action::Preempted, Action::Fail]);
    }

    #[test]
    fn failures_are_told_apart_by_node_and_status() {
        use tonic::{Code, Status};
        let refused = |node: &str, code| Failure::Refused {
            node: node.into(),
            status: Status::new(code, "x"),
        };
        assert_eq!(Fault::of(&refused("d", Code::ResourceExhausted), "d"), Fault::Full);
        assert_eq!(Fault::of(&refused("p", Code::ResourceExhausted), "d"), Fault::Elsewhere);
        assert_eq!(Fault::of(&refused("d", Code::Aborted), "d"), Fault::Preempted);
        assert_eq!(Fault::of(&refused("p", Code::Aborted), "d"), Fault::Final);
        assert_eq!(Fault::of(&refused("d", Code::InvalidArgument), "d"), Fault::Final);
        let lost = |node: &str| Failure::Lost { node: node.into(), why: "gone".into() };
        assert_eq!(Fault::of(&lost("d"), "d"), Fault::DecodeNode);
        assert_eq!(Fault::of(&lost("p"), "d"), Fault::Elsewhere);
        assert_eq!(Fault::of(&Failure::Cancelled, "d"), Fault::Final);
    }
}
