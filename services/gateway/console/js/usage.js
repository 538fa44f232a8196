// The Usage panel (#/usage): run credits used this billing period against the allowance (a bar),
// the next reset, token and tool usage in millicredits and the plan, from
// GET /dashboard/analytics/overview (the SDK's AnalyticsOverviewResponse).

import { h, notice } from "./dom.js";
import { fill, header, viewSignal } from "./kit.js";

export function renderUsage(root, ctx) {
  const { signal, cleanup } = viewSignal();
  const body = h("div", { id: "usage" });
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  const load = () =>
    fill(body, () => ctx.api.get("/dashboard/analytics/overview", null, signal), overview, signal);
  refresh.addEventListener("click", load);
  root.append(
    header(
      "Usage",
      "This billing period: one run credit per started turn; tokens and tool calls in millicredits.",
      refresh,
    ),
    body,
  );
  load();
  return cleanup;
}

function overview(answer) {
  const o = (answer.data && answer.data.overview) || {};
  const usage = o.current_month_credit_usage || {};
  const period = o.subscription || {};
  return [
    h("section", { class: "card" }, h("h2", {}, "Run credits"), creditBar(usage), periodLine(usage, period)),
    h(
      "section",
      { class: "card stats" },
      stat("Plan", usage.plan || "—"),
      stat(
        "Tokens and tools",
        typeof usage.usage_millicredits === "number" ? millicredits(usage.usage_millicredits) : "—",
      ),
      stat("Members", o.active_member_count),
      stat("Credentials", o.total_credentials_count),
      stat(
        "Integrations with a credential",
        `${o.configured_integrations_count ?? 0} of ${o.total_integrations_count ?? 0}`,
      ),
    ),
  ];
}

/** used / allowance as a <progress> and in words ("3 of 1,000 run credits used"). */
function creditBar(usage) {
  const used = Number(usage.used_credit) || 0;
  const max = typeof usage.max_credit === "number" ? usage.max_credit : null;
  const words =
    max === null
      ? `${fmt(used)} run credits used (no allowance set)`
      : `${fmt(used)} of ${fmt(max)} run credits used`;
  const bar = h("progress", {
    id: "credit-bar",
    max: String(Math.max(max || 0, 1)),
    value: String(max ? Math.min(used, max) : 0),
    "aria-label": words,
  });
  const over = max !== null && used >= max;
  return h(
    "div",
    { class: `credit ${over ? "over" : ""}` },
    bar,
    h("p", { class: "credit-words" }, words),
    over ? notice("info", "The allowance is used up: further turns use the wallet or are refused.") : null,
  );
}

function periodLine(usage, period) {
  const parts = [];
  if (usage.next_reset_date) parts.push(`Resets ${day(usage.next_reset_date)}`);
  if (period.current_period_start && period.current_period_end) {
    parts.push(`period ${day(period.current_period_start)} – ${day(period.current_period_end)}`);
  }
  return parts.length ? h("p", { class: "hint", id: "credit-reset" }, parts.join(" · ")) : null;
}

function stat(label, value) {
  const shown = value === undefined || value === null ? "—" : String(value);
  return h(
    "div",
    { class: "stat" },
    h("div", { class: "stat-value" }, shown),
    h("div", { class: "muted" }, label),
  );
}

function millicredits(m) {
  return `${fmt(m)} millicredits (${fmt(m / 1000)} credits)`;
}

function fmt(n) {
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: 3 });
}

function day(iso) {
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return String(iso);
  return date.toLocaleDateString(undefined, { dateStyle: "medium" });
}
