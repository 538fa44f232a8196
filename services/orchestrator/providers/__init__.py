"""Model providers behind one interface (`base.ChatModel`)."""
