// The Integrations panel (#/integrations): the integrations the organization has connected (a
// credential stored, or none needed) first, then a searchable, paged browse of the whole catalogue.
// Each opens to its actions (description, credit cost, effects), models and auth types.

import { h, plural, text } from "./dom.js";
import { fill, header, table, viewSignal } from "./kit.js";

const PAGE_SIZE = 20;
const TYPE_NAMES = { tool: "tool", llm_provider: "model provider", knowledge_provider: "knowledge" };
const AUTH_NAMES = {
  api_key: "API key",
  bearer_token: "Bearer token",
  oauth2: "OAuth2",
  custom: "Custom fields",
  mcp_server: "MCP server",
};

export function renderIntegrations(root, ctx) {
  const { signal, cleanup } = viewSignal();
  const connected = h("section", { class: "card", id: "connected" });
  root.append(
    header(
      "Integrations",
      "What the assistant can act on. Connected: a credential is stored, or none is needed.",
    ),
    h("h2", {}, "Connected"),
    connected,
    h("h2", {}, "Browse"),
    browser(ctx, signal),
  );
  fill(
    connected,
    () => ctx.api.get("/integrations/browse", { include_details: false, paginate: false }, signal),
    (page) => {
      const items = page.integrations.filter((i) => i.status === "connected");
      return items.length
        ? h("div", { class: "integration-list" }, items.map((i) => item(ctx, i, signal)))
        : h("p", { class: "muted empty" }, "Nothing connected yet.");
    },
    signal,
  );
  return cleanup;
}

/** The search box, type filter, results and pager of GET /integrations/browse. */
function browser(ctx, signal) {
  const search = h("input", {
    type: "search",
    name: "search",
    placeholder: "Search name, description, category",
    maxlength: "200",
  });
  const type = h(
    "select",
    { name: "type" },
    h("option", { value: "" }, "All types"),
    Object.entries(TYPE_NAMES).map(([value, label]) => h("option", { value }, label)),
  );
  const results = h("div", { id: "browse-results" });
  const pager = h("div", { class: "row pager" });
  let page = 1;
  let timer = null;
  signal.addEventListener("abort", () => clearTimeout(timer));
  const load = () =>
    fill(
      results,
      () =>
        ctx.api.get(
          "/integrations/browse",
          {
            search: search.value.trim() || null,
            type: type.value || null,
            include_details: false,
            page,
            page_size: PAGE_SIZE,
          },
          signal,
        ),
      (found) => {
        pager.replaceChildren(...pagerButtons(found, (to) => ((page = to), load())));
        return found.integrations.length
          ? h("div", { class: "integration-list" }, found.integrations.map((i) => item(ctx, i, signal)))
          : h("p", { class: "muted empty" }, "No integration matches.");
      },
      signal,
    );
  const again = () => {
    page = 1;
    clearTimeout(timer);
    timer = setTimeout(load, 250);
  };
  search.addEventListener("input", again);
  type.addEventListener("change", again);
  const form = h(
    "form",
    { class: "card", id: "browse", role: "search" },
    h("div", { class: "row" }, h("div", { class: "grow" }, search), type),
    results,
    pager,
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    page = 1;
    clearTimeout(timer);
    load();
  });
  load();
  return form;
}

function pagerButtons(found, go) {
  const last = Math.max(1, Math.ceil(found.total / found.page_size));
  const button = (label, disabled) =>
    h("button", { type: "button", class: "secondary small", disabled }, label);
  const prev = button("← Previous", found.page <= 1);
  const next = button("Next →", !found.has_more);
  prev.addEventListener("click", () => go(found.page - 1));
  next.addEventListener("click", () => go(found.page + 1));
  const where = h("span", { class: "muted" }, `Page ${found.page} of ${last} · ${plural(found.total, "integration")}`);
  return [prev, where, next];
}

/** One integration, closed: its name, type, status and categories; opening it loads its detail. */
function item(ctx, i, signal) {
  const body = h("div", { class: "integration-body" });
  const details = h(
    "details",
    { class: "integration", dataset: { integration: i.name } },
    h(
      "summary",
      {},
      h("strong", {}, text(i.display_name || i.name)),
      " ",
      h("span", { class: "mono muted" }, i.name),
      " ",
      h("span", { class: `badge ${i.status === "connected" ? "ok" : ""}` }, i.status),
      " ",
      h("span", { class: "badge" }, TYPE_NAMES[i.integration_type] || i.integration_type),
      i.description ? h("div", { class: "muted summary-text" }, text(i.description)) : null,
    ),
    body,
  );
  let loaded = false;
  details.addEventListener("toggle", () => {
    if (!details.open || loaded) return;
    loaded = true;
    const path = `/integrations/${encodeURIComponent(i.name)}`;
    fill(body, () => ctx.api.get(path, null, signal), detailView, signal);
  });
  return details;
}

/** An integration's detail: categories, auth types (with a link to add a credential), models and
 * actions with their cost and effects. */
function detailView(d) {
  const meta = d.metadata || {};
  const costs = meta.actions || {};
  const auth = d.auth_schemas || [];
  return [
    d.categories.length
      ? h("p", { class: "row" }, d.categories.map((c) => h("span", { class: "badge" }, c)))
      : null,
    h(
      "p",
      {},
      h("strong", {}, "Auth: "),
      auth.length
        ? auth.map((s) => AUTH_NAMES[s.auth_type] || s.auth_type).join(", ")
        : "no credential needed",
      auth.length && d.integration_type === "tool"
        ? [" · ", h("a", { href: `#/credentials/${encodeURIComponent(d.name)}` }, "Add a credential")]
        : null,
    ),
    d.models && d.models.length
      ? h("p", {}, h("strong", {}, "Models: "), d.models.map((m) => m.id).join(", "))
      : null,
    d.actions && d.actions.length
      ? table(
          ["Action", "What it does", "Cost", "Effects"],
          d.actions.map((a) => [
            h("span", {}, a.display_name, h("br"), h("span", { class: "mono muted" }, a.name)),
            a.description,
            cost(costs[a.name]),
            effects(costs[a.name]),
          ]),
          "",
          { class: "actions" },
        )
      : null,
  ];
}

function cost(info) {
  if (!info || typeof info.credit_cost_millicredits !== "number") return "";
  const m = info.credit_cost_millicredits;
  return m === 0 ? "free" : `${m} millicredits`;
}

function effects(info) {
  const list = (info && info.effects) || [];
  if (!list.length) return h("span", { class: "muted" }, "reads only");
  return list.map((e) => h("span", { class: "badge effect" }, e));
}
