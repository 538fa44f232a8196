// The organization's panels, one module each: what app.js routes #/credentials, #/knowledge,
// #/integrations, #/keys and #/usage to. Shared pieces are in kit.js.

export { renderCredentials } from "./credentials.js";
export { renderIntegrations } from "./integrations.js";
export { renderKeys } from "./keys.js";
export { renderKnowledge } from "./knowledge.js";
export { renderUsage } from "./usage.js";
