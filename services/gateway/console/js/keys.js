// The API keys panel (#/keys): the organization's keys (revoked ones behind a toggle), a form to
// create one, which shows the new key once with a copy button, and revoke with a confirmation.
//
// The new key lives only in the node that shows it: never stored, gone when the view is left.

import { h, notice, text } from "./dom.js";
import {
  busy,
  confirmButton,
  describe,
  endOfDay,
  field,
  fill,
  header,
  table,
  time,
  viewSignal,
} from "./kit.js";

/** The confirmation of a revoke; it warns when `key` is the one this tab is signed in with (its
 * listed prefix starts the session's key: the console never holds a key's id). */
function revokeQuestion(ctx, key) {
  const mine = Boolean(key.key_hint) && ctx.api.apiKey.startsWith(key.key_hint);
  return mine
    ? "This is the key this console is signed in with: revoking it signs you out. Revoke it?"
    : "Revoke this key? Requests with it stop at once.";
}

export function renderKeys(root, ctx) {
  const { signal, cleanup } = viewSignal();
  const status = h("div", { class: "status", "aria-live": "polite" });
  const fresh = h("div", { id: "new-key" });
  const list = h("section", { class: "card", id: "key-list" });
  const revoked = h("input", { type: "checkbox", name: "include_revoked" });
  const reload = () =>
    fill(
      list,
      () => ctx.api.get("/api-keys", { include_revoked: revoked.checked }, signal),
      (page) => keysTable(ctx, page, status, reload),
      signal,
    );
  revoked.addEventListener("change", reload);
  root.append(
    header("API keys", "Keys for the HTTP API and the SDK, bound to this organization."),
    createForm(ctx, signal, status, (created) => {
      fresh.replaceChildren(shownOnce(created));
      reload();
    }),
    fresh,
    status,
    h("label", { class: "check" }, revoked, " Show revoked keys"),
    list,
  );
  reload();
  return cleanup;
}

function createForm(ctx, signal, status, created) {
  const name = h("input", { type: "text", name: "key_name", required: true, maxlength: "200" });
  const expires = h("input", { type: "date", name: "key_expires" });
  const rate = h("input", {
    type: "number",
    name: "rate_limit",
    min: "1",
    step: "1",
    class: "narrow",
    placeholder: "default",
  });
  const save = h("button", { type: "submit" }, "Create key");
  const form = h(
    "form",
    { class: "card", id: "key-create" },
    h("h2", {}, "New API key"),
    h(
      "div",
      { class: "row top" },
      h("div", { class: "grow" }, field("Name", name)),
      field("Expires", expires, "optional: end of that day"),
      field("Requests a minute", rate, "optional"),
    ),
    save,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { name: name.value.trim() };
    const at = endOfDay(expires.value);
    if (at) body.expires_at = at;
    if (rate.value) body.rate_limit_per_minute = Number(rate.value);
    const key = await busy(save, status, () => ctx.api.post("/api-keys", body, signal));
    if (!key) return;
    form.reset();
    created(key);
  });
  return form;
}

/** The new key with a copy button and the warning that it is shown this once. */
function shownOnce(created) {
  const value = h("input", {
    type: "text",
    readonly: true,
    value: created.key,
    class: "mono grow",
    id: "new-key-value",
    "aria-label": "The new API key",
  });
  const copy = h("button", { type: "button", id: "copy-key" }, "Copy");
  const copied = h("span", { class: "muted", "aria-live": "polite" });
  copy.addEventListener("click", async () => {
    value.select();
    try {
      await navigator.clipboard.writeText(value.value);
      copied.textContent = "Copied.";
    } catch {
      copied.textContent = "Press Ctrl+C (⌘C) to copy the selected key.";
    }
  });
  const hide = h("button", { type: "button", class: "secondary" }, "Done");
  const box = h(
    "div",
    { class: "card key-once", role: "alert" },
    h("h2", {}, "Key “", text(created.name), "” created"),
    h("p", { class: "warn" }, "Copy it now: you will not see it again. It is stored only as a hash."),
    h("div", { class: "row" }, value, copy, hide),
    copied,
  );
  hide.addEventListener("click", () => box.remove());
  return box;
}

function keysTable(ctx, page, status, reload) {
  const rows = page.keys.map((k) =>
    h(
      "tr",
      { dataset: { keyId: k.id }, class: k.is_active ? "" : "inactive" },
      h("td", { class: "key-name" }, text(k.name)),
      h("td", { class: "mono" }, k.masked_key || k.key_hint || ""),
      h("td", {}, time(k.created_at)),
      h("td", {}, time(k.expires_at)),
      h("td", {}, time(k.last_used_at)),
      h("td", {}, k.rate_limit_per_minute ? `${k.rate_limit_per_minute}/min` : "unlimited"),
      h("td", {}, state(k)),
      h(
        "td",
        {},
        k.revoked_at
          ? null
          : confirmButton("Revoke", revokeQuestion(ctx, k), async () => {
              try {
                await ctx.api.delete(`/api-keys/${encodeURIComponent(k.id)}`);
                status.replaceChildren(notice("ok", "Revoked ", text(k.name), "."));
                reload();
              } catch (error) {
                status.replaceChildren(notice("error", describe(error)));
              }
            }),
      ),
    ),
  );
  return [
    table(
      ["Name", "Key", "Created", "Expires", "Last used", "Rate limit", "State", ""],
      rows,
      "No API keys.",
    ),
    h("p", { class: "hint" }, `At most ${page.max_keys} active keys per organization.`),
  ];
}

function state(k) {
  if (k.revoked_at) return h("span", { class: "badge failed" }, "revoked");
  if (k.is_expired) return h("span", { class: "badge awaiting" }, "expired");
  return h("span", { class: "badge ok" }, k.organization_id ? "active" : "active · all organizations");
}
