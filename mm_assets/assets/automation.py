"""When Dagster's automation materializes a partition: only when something it depends on
really changed.

Plain `AutomationCondition.eager()` recomputes everything downstream of any update; an
update that rewrote identical data would then regenerate hidden states and retrain. Every
asset here reports a content data version (a hash of what it wrote) and a `code_version`,
so the condition can ask for exactly the cases that change results.
"""

from __future__ import annotations

import dagster as dg


def materialize_on_change() -> dg.AutomationCondition:
    """Missing, code version changed, or an upstream data version changed — and only while
    every upstream partition exists, is not being computed, and passed its blocking checks."""
    trigger = (
        dg.AutomationCondition.newly_missing()
        | dg.AutomationCondition.code_version_changed()
        | dg.AutomationCondition.any_deps_match(dg.AutomationCondition.data_version_changed())
    ).since_last_handled()
    return (
        trigger
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
        & dg.AutomationCondition.all_deps_blocking_checks_passed()
    ).with_label("materialize on change")
