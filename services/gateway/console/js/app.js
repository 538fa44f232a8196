// The console's shell: sign-in, the navigation and the hash router.
//
// Each view is a function (root, ctx) that fills `root` and may return a cleanup function,
// called when the user navigates away (it aborts the view's streams and timers).
// ctx = {api, me, navigate}.

import { Api, ApiError } from "./api.js";
import { renderChat, renderChats } from "./chat.js";
import { h, clear, notice } from "./dom.js";
import {
  renderCredentials,
  renderIntegrations,
  renderKeys,
  renderKnowledge,
  renderUsage,
} from "./panels.js";

const VIEWS = {
  chats: (root, ctx) => renderChats(root, ctx),
  chat: (root, ctx, id) => renderChat(root, ctx, id || null),
  credentials: renderCredentials,
  knowledge: renderKnowledge,
  integrations: renderIntegrations,
  keys: renderKeys,
  usage: renderUsage,
};

let cleanup = null;
let session = null; // {api, me}

function navigate(hash) {
  if (window.location.hash === hash) route();
  else window.location.hash = hash;
}

function route() {
  if (cleanup) {
    cleanup();
    cleanup = null;
  }
  const root = clear(document.getElementById("view"));
  if (!session) {
    renderSignIn(root);
    return;
  }
  const [name, ...rest] = window.location.hash.replace(/^#\/?/, "").split("/");
  const view = VIEWS[name] ? name : "chats";
  for (const link of document.querySelectorAll("#nav a")) {
    const current = link.dataset.nav === (view === "chat" ? "chats" : view);
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const id = rest.length ? decodeURIComponent(rest.join("/")) : undefined;
  try {
    cleanup = VIEWS[view](root, { ...session, navigate }, id) || null;
  } catch (error) {
    root.append(notice("error", `This page failed: ${error.message}`));
  }
}

function showSession() {
  const signedIn = Boolean(session);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("sign-out").hidden = !signedIn;
  const who = document.getElementById("who");
  who.textContent = signedIn
    ? `${session.me.email || session.me.id} · ${session.api.organizationId}` +
      (session.me.role ? ` (${session.me.role})` : "")
    : "";
}

/** Check `api` against GET /auth/me; the profile, or throws ApiError. */
async function whoAmI(api) {
  return api.get("/auth/me");
}

function renderSignIn(root) {
  const key = h("input", { type: "password", name: "api_key", required: true, autocomplete: "off" });
  const org = h("input", { type: "text", name: "organization_id", required: true });
  const status = h("div", { class: "status" });
  const form = h(
    "form",
    { class: "card sign-in", id: "sign-in" },
    h("h1", {}, "Sign in"),
    h("p", { class: "hint" }, "Kept in this tab only; closing the tab forgets it."),
    h("label", {}, "API key", key),
    h("label", {}, "Organization id", org),
    h("button", { type: "submit" }, "Sign in"),
    status,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const api = new Api(key.value.trim(), org.value.trim());
    clear(status);
    try {
      const me = await whoAmI(api);
      api.save();
      session = { api, me };
      showSession();
      navigate(window.location.hash && window.location.hash !== "#/" ? window.location.hash : "#/chats");
    } catch (error) {
      const text =
        error instanceof ApiError ? `${error.status}: ${error.detail}` : "The gateway cannot be reached.";
      status.append(notice("error", text));
    }
  });
  root.append(form);
  key.focus();
}

async function start() {
  document.getElementById("sign-out").addEventListener("click", () => {
    Api.forget();
    session = null;
    showSession();
    navigate("#/");
  });
  window.addEventListener("hashchange", route);
  const api = Api.load();
  if (api) {
    try {
      session = { api, me: await whoAmI(api) };
    } catch {
      Api.forget();
      session = null;
    }
  }
  showSession();
  route();
}

start();
